// Cache-hit allocation latency: our pool vs glibc malloc vs torch's default
// CPU allocator, side by side in one process.
//
//   build/py/benchmarks/pool_latency    (make bench-memory)
//
// For each size, after a warm-up that leaves one cached block of that size,
// times 200,000 alloc+free pairs one by one with a monotonic clock and reports
// p50 / p99 of the pair in nanoseconds (timer overhead, measured the same way
// on an empty pair, subtracted).
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "mapp/memory/pool.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kIters = 200000;

struct Pct {
  double p50, p99;
};

Pct measure(const std::function<void()>& pair, double overhead) {
  std::vector<double> ns(kIters);
  for (int i = 0; i < 1000; ++i) pair();
  for (int i = 0; i < kIters; ++i) {
    const auto t0 = Clock::now();
    pair();
    const auto t1 = Clock::now();
    ns[i] = std::chrono::duration<double, std::nano>(t1 - t0).count() - overhead;
  }
  std::sort(ns.begin(), ns.end());
  return {std::max(0.0, ns[kIters / 2]), std::max(0.0, ns[kIters * 99 / 100])};
}

}  // namespace

int main() {
  const double overhead = measure([] {}, 0.0).p50;
  mapp::HostDevice device;
  mapp::PoolOptions options;
  options.expandable_segments = true;
  options.va_bytes = std::size_t(64) << 30;
  mapp::CachingPool pool(device, options);
  c10::Allocator* torch_cpu = c10::GetDefaultCPUAllocator();
  std::printf("cache-hit alloc+free pair latency, ns (timer overhead %.1f ns subtracted)\n",
              overhead);
  std::printf("%10s | %9s %9s | %9s %9s | %9s %9s | %12s %12s\n", "size", "ours p50",
              "ours p99", "malloc p50", "p99", "torch p50", "p99", "malloc/ours", "torch/ours");
  for (std::size_t size : {64ul, 4096ul, 65536ul, 1ul << 20, 16ul << 20}) {
    volatile void* sink = nullptr;
    const Pct ours = measure([&] {
      void* p = pool.allocate(size);
      sink = p;
      pool.deallocate(p);
    }, overhead);
    const Pct sys = measure([&] {
      void* p = std::malloc(size);
      sink = p;
      std::free(p);
    }, overhead);
    const Pct th = measure([&] {
      c10::DataPtr p = torch_cpu->allocate(size);
      sink = p.get();
    }, overhead);
    (void)sink;
    const std::string label = size >= (1u << 20) ? std::to_string(size >> 20) + " MiB"
                              : size >= 1024     ? std::to_string(size >> 10) + " KiB"
                                                 : std::to_string(size) + " B";
    std::printf("%10s | %9.1f %9.1f | %9.1f %9.1f | %9.1f %9.1f | %11.2fx %11.2fx\n",
                label.c_str(), ours.p50, ours.p99, sys.p50, sys.p99, th.p50, th.p99,
                sys.p50 / std::max(ours.p50, 1.0), th.p50 / std::max(ours.p50, 1.0));
  }
  return 0;
}
