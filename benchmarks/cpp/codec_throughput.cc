// Codec encode+decode throughput on the CPU (one core) against a plain memory
// copy of the same buffer, side by side.
//
//   build/py/benchmarks/codec_throughput [MiB]      (make bench-codecs)
//
// GB/s counts the float32 input bytes; each number is the best of 5 runs.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "mapp/codec/codec.h"

namespace {

double best_seconds(const std::function<void()>& f) {
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mapp::codec;
  const std::size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 64;
  const std::int64_t n = static_cast<std::int64_t>(mib * 1024 * 1024 / 4);
  std::vector<float> x(n), err(n, 0.f), out(n);
  std::mt19937 rng(0);
  std::normal_distribution<float> d;
  for (auto& v : x) v = d(rng);
  const double gb = 4.0 * n / 1e9;
  const double copy_s = best_seconds([&] { std::memcpy(out.data(), x.data(), 4 * n); });
  std::printf("codec throughput, %zu MiB float32 buffer, 1 core, best of 5\n", mib);
  std::printf("%-12s %12s %12s %14s %12s\n", "codec", "ratio", "enc+dec GB/s", "vs memcpy", "enc GB/s");
  std::printf("%-12s %12s %12.2f %13.2fx %12s\n", "memcpy", "1.000", gb / copy_s, 1.0, "-");
  for (const char* name : {"bf16", "fp16", "int8", "onebit", "topk:0.01"}) {
    const Spec s = Spec::parse(name);
    std::vector<std::uint8_t> payload(encoded_bytes(s, n));
    double enc_s = 0, all_s = 0;
    if (s.kind == Kind::kTopK) {
      const std::int64_t k = topk_count(s, n);
      enc_s = best_seconds([&] { topk_encode(x.data(), n, k, payload.data()); });
      all_s = best_seconds([&] {
        topk_encode(x.data(), n, k, payload.data());
        std::memset(out.data(), 0, 4 * n);
        topk_decode_add(payload.data(), k, n, out.data());
      });
    } else {
      enc_s = best_seconds([&] { encode_with_feedback(s, x.data(), err.data(), n, payload.data()); });
      all_s = best_seconds([&] {
        encode_with_feedback(s, x.data(), err.data(), n, payload.data());
        decode(s, payload.data(), n, out.data());
      });
    }
    std::printf("%-12s %12.3f %12.2f %13.2fx %12.2f\n", name,
                double(payload.size()) / (4.0 * n), gb / all_s, copy_s / all_s, gb / enc_s);
  }
  return 0;
}
