// Cache-hit allocation latency: our pool vs glibc malloc vs torch's default
// CPU allocator, side by side in one process.
//
//   build/py/benchmarks/pool_latency    (make bench-memory)
//
// For each size, after a warm-up that leaves one cached block of that size,
// times 200,000 alloc+free pairs one by one with a monotonic clock and reports
// p50 / p99 of the pair in nanoseconds (timer overhead, measured the same way
// on an empty pair, subtracted). Ours runs twice: with the thread cache the CPU
// pool uses, and locked (no thread cache). A second table runs two threads at
// once (contention on the pool's mutex, glibc's arenas, torch's reporter).
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
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

// Two threads at once, each timing its own `pairs` in one clock read pair:
// ns per alloc+free pair (mean over the thread's loop, slower thread reported).
double concurrent_ns(const std::function<void()>& pair, int threads) {
  constexpr int kPairs = 2000000;
  std::vector<double> ns(threads);
  std::vector<std::thread> pool;
  std::atomic<int> ready{0};
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) pair();
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      const auto t0 = Clock::now();
      for (int i = 0; i < kPairs; ++i) pair();
      ns[t] = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kPairs;
    });
  }
  for (auto& th : pool) th.join();
  return *std::max_element(ns.begin(), ns.end());
}

// Keeps a pointer observable, so that an alloc+free pair is not optimised away.
inline void keep(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

// One alloc+free pair of `size` bytes through each allocator compared.
struct Pairs {
  std::function<void()> ours, locked, malloc, torch;
};

Pairs pairs_of(std::size_t size, mapp::CachingPool& pool, mapp::CachingPool& locked,
               c10::Allocator* torch_cpu) {
  auto through = [size](mapp::CachingPool& p) {
    return [&p, size] {
      void* ptr = p.allocate(size);
      keep(ptr);
      p.deallocate(ptr);
    };
  };
  return {through(pool), through(locked),
          [size] {
            void* p = std::malloc(size);
            keep(p);
            std::free(p);
          },
          [size, torch_cpu] {
            c10::DataPtr p = torch_cpu->allocate(size);
            keep(p.get());
          }};
}

std::string label_of(std::size_t size) {
  return size >= (1u << 20) ? std::to_string(size >> 20) + " MiB"
         : size >= 1024     ? std::to_string(size >> 10) + " KiB"
                            : std::to_string(size) + " B";
}

}  // namespace

int main() {
  const double overhead = measure([] {}, 0.0).p50;
  mapp::HostDevice device;
  // As megatronapp.memory.use_pool("cpu") installs it: expandable segments and
  // its default thread cache (Note [Thread cache]) ...
  mapp::PoolOptions options;
  options.expandable_segments = true;
  options.va_bytes = std::size_t(64) << 30;
  options.thread_cache_bytes = mapp::PoolOptions::kDefaultThreadCacheBytes;
  mapp::CachingPool pool(device, options);
  // ... and without it: every operation takes the pool's mutex.
  mapp::PoolOptions locked_options = options;
  locked_options.thread_cache_bytes = 0;
  mapp::CachingPool locked(device, locked_options);
  c10::Allocator* torch_cpu = c10::GetDefaultCPUAllocator();
  std::printf("cache-hit alloc+free pair latency, ns (timer overhead %.1f ns subtracted)\n",
              overhead);
  std::printf("%8s | %8s %8s | %8s %8s | %8s %8s | %8s %8s | %11s %10s\n", "size", "ours p50",
              "p99", "locked50", "p99", "malloc50", "p99", "torch p50", "p99", "malloc/ours",
              "torch/ours");
  for (std::size_t size : {64ul, 4096ul, 65536ul, 1ul << 20, 16ul << 20}) {
    const Pairs p = pairs_of(size, pool, locked, torch_cpu);
    const Pct ours = measure(p.ours, overhead);
    const Pct lk = measure(p.locked, overhead);
    const Pct sys = measure(p.malloc, overhead);
    const Pct th = measure(p.torch, overhead);
    std::printf("%8s | %8.1f %8.1f | %8.1f %8.1f | %8.1f %8.1f | %8.1f %8.1f | %10.2fx %9.2fx\n",
                label_of(size).c_str(), ours.p50, ours.p99, lk.p50, lk.p99, sys.p50, sys.p99,
                th.p50, th.p99, sys.p50 / std::max(ours.p50, 0.5),
                th.p50 / std::max(ours.p50, 0.5));
  }
  std::printf("\ntwo threads at once, each its own alloc+free pairs: ns per pair (mean, slower "
              "thread; no timer overhead)\n");
  std::printf("%8s | %8s | %8s | %8s | %8s\n", "size", "ours", "locked", "malloc", "torch");
  for (std::size_t size : {64ul, 65536ul, 1ul << 20}) {
    const Pairs p = pairs_of(size, pool, locked, torch_cpu);
    std::printf("%8s | %8.1f | %8.1f | %8.1f | %8.1f\n", label_of(size).c_str(),
                concurrent_ns(p.ours, 2), concurrent_ns(p.locked, 2), concurrent_ns(p.malloc, 2),
                concurrent_ns(p.torch, 2));
  }
  return 0;
}
