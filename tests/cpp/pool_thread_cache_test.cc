// Note [Thread cache]: the per-thread front of CachingPool.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "mapp/memory/pool.h"
#include "mapp/memory/trace.h"

namespace mapp {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = kKiB * kKiB;

void expect_valid(const CachingPool& pool) {
  std::string why;
  ASSERT_TRUE(pool.is_valid(&why)) << why;
}

PoolOptions cached(std::size_t thread_cache_bytes = 8 * kMiB) {
  PoolOptions o;
  o.expandable_segments = true;
  o.va_bytes = 1024 * kMiB;
  o.thread_cache_bytes = thread_cache_bytes;
  o.name = "thread-cached";
  return o;
}

// A thread that runs what it is given, one call at a time, and stays alive
// between calls (so its thread cache does too).
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void run(std::function<void()> f) {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = std::move(f);
    cv_.notify_all();
    cv_.wait(lock, [this] { return !job_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || job_; });
      if (job_) {
        job_();
        job_ = nullptr;
        cv_.notify_all();
      } else {
        return;
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool stop_ = false;
  std::thread thread_;
};

TEST(ThreadCache, SameSizeFreeAndAllocateReuseTheCachedBlock) {
  HostDevice dev;
  CachingPool pool(dev, cached());
  void* a = pool.allocate(1000);
  pool.deallocate(a);
  PoolStats s = pool.stats();
  EXPECT_EQ(s.thread_cached_bytes, 1024u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.active_bytes, 1024u);  // to the pool a cached block is still out
  EXPECT_FALSE(pool.owns(a));
  EXPECT_THROW(pool.block_size(a), ValueError);
  EXPECT_THROW(pool.record_stream(a, 1), ValueError);
  EXPECT_THROW(pool.deallocate(a), ValueError);  // double free of a cached block
  expect_valid(pool);

  void* b = pool.allocate(900);  // same 1 KiB block, from the cache
  EXPECT_EQ(a, b);
  s = pool.stats();
  EXPECT_EQ(s.num_allocs, 2u);
  EXPECT_EQ(s.num_frees, 1u);
  EXPECT_EQ(s.num_cache_hits, 1u);
  EXPECT_EQ(s.allocated_bytes, 900u);
  EXPECT_EQ(s.peak_allocated_bytes, 1000u);
  EXPECT_EQ(s.thread_cached_bytes, 0u);
  EXPECT_TRUE(pool.owns(b));
  void* c = pool.allocate(1500);  // another size: the locked path
  s = pool.stats();
  EXPECT_EQ(s.peak_allocated_bytes, 2400u);
  pool.deallocate(b);
  pool.deallocate(c);
  EXPECT_EQ(pool.stats().thread_cached_bytes, 1024u + 1536u);
  expect_valid(pool);

  pool.release_cached();  // the calling thread's cache goes back at once
  s = pool.stats();
  EXPECT_EQ(s.thread_cached_bytes, 0u);
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(dev.used_bytes(), 0u);
  expect_valid(pool);
}

TEST(ThreadCache, LastFreedBlockAndBoundedBins) {
  HostDevice dev;
  // Bins: 16 KiB in all, blocks up to 8 KiB, 4 per size; the block freed last
  // up to 16 x 16 KiB.
  CachingPool pool(dev, cached(16 * kKiB));
  std::vector<void*> ptrs;
  for (int i = 0; i < 6; ++i) ptrs.push_back(pool.allocate(kKiB));
  for (void* p : ptrs) pool.deallocate(p);
  // p5 is the last freed; p0..p3 fill the 1 KiB bin; p4 (freed last before
  // p5, but its bin was full) went back to the pool.
  EXPECT_EQ(pool.stats().thread_cached_bytes, 5 * kKiB);
  expect_valid(pool);
  for (int i : {5, 3, 2, 1, 0}) EXPECT_EQ(pool.allocate(kKiB), ptrs[i]);  // newest first
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);
  for (int i : {5, 3, 2, 1, 0}) pool.deallocate(ptrs[i]);
  EXPECT_EQ(pool.stats().thread_cached_bytes, 5 * kKiB);

  void* big = pool.allocate(64 * kKiB);  // too large for the bins, not as the last freed
  pool.deallocate(big);  // p0 cannot move to its full bin: it goes back instead
  EXPECT_EQ(pool.stats().thread_cached_bytes, 4 * kKiB + 64 * kKiB);
  void* huge = pool.allocate(512 * kKiB);  // over 16 x 16 KiB: never cached
  pool.deallocate(huge);
  EXPECT_EQ(pool.stats().thread_cached_bytes, 4 * kKiB + 64 * kKiB);
  EXPECT_EQ(pool.allocate(64 * kKiB), big);  // the last freed block, same size
  pool.deallocate(big);
  expect_valid(pool);

  std::vector<void*> x;
  for (int i = 0; i < 3; ++i) x.push_back(pool.allocate(8 * kKiB));
  pool.deallocate(x[0]);  // `big` fits no bin: back to the pool
  pool.deallocate(x[1]);  // x0 to its bin: 4 + 8 KiB binned
  pool.deallocate(x[2]);  // x1 would make 20 KiB > 16 binned: back to the pool
  EXPECT_EQ(pool.stats().thread_cached_bytes, 12 * kKiB + 8 * kKiB);
  expect_valid(pool);
  pool.release_cached();
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
}

TEST(ThreadCache, CachedBlocksGoBackBeforeThePoolGrows) {
  HostDevice dev;
  CachingPool pool(dev, cached());
  void* a = pool.allocate(kMiB);
  void* b = pool.allocate(kMiB);
  pool.deallocate(a);
  pool.deallocate(b);  // both cached; together they are the whole 2 MiB mapped
  PoolStats s = pool.stats();
  EXPECT_EQ(s.thread_cached_bytes, 2 * kMiB);
  const std::uint64_t reserved = s.reserved_bytes, device_allocs = s.num_device_allocs;
  void* c = pool.allocate(2 * kMiB);  // fits only once a and b merge
  s = pool.stats();
  EXPECT_EQ(s.reserved_bytes, reserved);
  EXPECT_EQ(s.num_device_allocs, device_allocs);
  EXPECT_EQ(s.thread_cached_bytes, 0u);
  EXPECT_EQ(c, a);
  pool.deallocate(c);
  expect_valid(pool);
}

TEST(ThreadCache, OtherStreamsAndCrossStreamUseTakeTheLockedPath) {
  HostDevice::Options d;
  d.manual_events = true;
  HostDevice dev(d);
  CachingPool pool(dev, cached());
  void* s1 = pool.allocate(kKiB, /*stream=*/1);
  pool.deallocate(s1);
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);  // stream 1: not cached
  void* a = pool.allocate(kKiB);
  pool.record_stream(a, 2);
  pool.deallocate(a);  // pending on stream 2's event, not cached
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);
  EXPECT_NE(pool.allocate(kKiB), a);
  expect_valid(pool);
  dev.complete_events();
}

TEST(ThreadCache, FreesFromOtherThreadsAndStaleEntries) {
  HostDevice dev;
  CachingPool pool(dev, cached());
  Worker w;
  void* p = nullptr;
  w.run([&] { p = pool.allocate(3 * kKiB); });
  pool.deallocate(p);  // allocated by the worker, freed here: locked path
  EXPECT_EQ(pool.stats().allocated_bytes, 0u);
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);
  // The same address comes back to this thread; the worker's map entry for it
  // is stale. The worker frees it (handed over): not into the worker's cache.
  void* q = pool.allocate(3 * kKiB);
  EXPECT_EQ(q, p);
  w.run([&] { pool.deallocate(q); });
  expect_valid(pool);
  PoolStats s = pool.stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.thread_cached_bytes, 0u);
  w.run([&] {
    void* r = pool.allocate(3 * kKiB);
    EXPECT_EQ(r, p);
    pool.deallocate(r);  // its own now: cached by the worker
  });
  EXPECT_EQ(pool.stats().thread_cached_bytes, 3 * kKiB);
  EXPECT_THROW(pool.deallocate(p), ValueError);  // freed (cached) by the worker
  expect_valid(pool);
}

TEST(ThreadCache, OtherThreadsGiveTheirCacheBackAtTheirNextOperationAndAtExit) {
  HostDevice dev;
  CachingPool pool(dev, cached());
  {
    Worker w;
    w.run([&] { pool.deallocate(pool.allocate(64 * kKiB)); });
    EXPECT_EQ(pool.stats().thread_cached_bytes, 64 * kKiB);
    pool.release_cached();  // asks the worker
    EXPECT_EQ(pool.stats().thread_cached_bytes, 64 * kKiB);
    w.run([&] { pool.deallocate(pool.allocate(kKiB)); });  // next operation: flushes first
    EXPECT_EQ(pool.stats().thread_cached_bytes, kKiB);
    expect_valid(pool);
  }  // the worker exits: its cache goes back and its counts stay
  const PoolStats s = pool.stats();
  EXPECT_EQ(s.thread_cached_bytes, 0u);
  EXPECT_EQ(s.num_allocs, 2u);
  EXPECT_EQ(s.num_frees, 2u);
  EXPECT_EQ(s.peak_allocated_bytes, 64 * kKiB);
  expect_valid(pool);
  pool.release_cached();
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
}

TEST(ThreadCache, PeakResetAppliesToThreadCaches) {
  HostDevice dev;
  CachingPool pool(dev, cached());
  Worker w;
  w.run([&] {
    void* a = pool.allocate(256 * kKiB);
    pool.deallocate(a);
    pool.deallocate(pool.allocate(256 * kKiB));  // a cache hit
  });
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 256 * kKiB);
  pool.reset_peak_stats();
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 0u);
  w.run([&] { pool.deallocate(pool.allocate(kKiB)); });
  EXPECT_EQ(pool.stats().peak_allocated_bytes, kKiB);
  w.run([&] { pool.deallocate(pool.allocate(256 * kKiB)); });  // hit again
  EXPECT_EQ(pool.stats().peak_allocated_bytes, 256 * kKiB);
}

TEST(ThreadCache, RecordingSeesEveryOperation) {
  HostDevice dev;
  CachingPool pool(dev, cached());
  pool.deallocate(pool.allocate(kKiB));  // cached before recording
  AllocTraceRecorder rec;
  pool.set_recorder(&rec);
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);
  for (int i = 0; i < 10; ++i) pool.deallocate(pool.allocate(kKiB));
  pool.set_recorder(nullptr);
  EXPECT_EQ(rec.trace().events.size(), 20u);
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);
  pool.deallocate(pool.allocate(kKiB));  // the fast path is back
  EXPECT_EQ(pool.stats().thread_cached_bytes, kKiB);
}

TEST(ThreadCache, PoolDestroyedWhileThreadsStillHoldCaches) {
  HostDevice dev;
  Worker w;
  for (int round = 0; round < 3; ++round) {
    auto pool = std::make_unique<CachingPool>(dev, cached());
    w.run([&] { pool->deallocate(pool->allocate(4 * kKiB)); });
    EXPECT_EQ(pool->stats().thread_cached_bytes, 4 * kKiB);
    pool.reset();  // the worker's cache for it is dead; a new pool may take its address
  }
  auto pool = std::make_unique<CachingPool>(dev, cached());
  w.run([&] { pool->deallocate(pool->allocate(4 * kKiB)); });
  expect_valid(*pool);
  pool.reset();
  EXPECT_EQ(dev.used_bytes(), 0u);
}

TEST(ThreadCache, OffMeansNoCache) {
  HostDevice dev;
  CachingPool pool(dev, cached(0));
  pool.deallocate(pool.allocate(kKiB));
  EXPECT_EQ(pool.stats().thread_cached_bytes, 0u);
  EXPECT_THROW(CachingPool(dev, cached(100)).stats(), ValueError);
}

// Threads allocate, free their own blocks and each other's (through a shared
// mailbox), and check that no block was handed out twice (a tag at each end).
TEST(ThreadCache, ManyThreadsStress) {
  HostDevice::Options d;
  d.capacity_bytes = 1024 * kMiB;
  HostDevice dev(d);
  PoolOptions o = cached(2 * kMiB);
  o.va_bytes = 0;
  CachingPool pool(dev, o);
  constexpr int kThreads = 4;
  constexpr int kOps = 100000;
  std::mutex mailbox_mu;
  std::vector<std::pair<void*, std::size_t>> mailbox;
  std::vector<std::uint64_t> allocs(kThreads), frees(kThreads);
  std::vector<std::thread> threads;
  auto tag_of = [](void* p, std::size_t n) {
    return reinterpret_cast<std::uintptr_t>(p) * 31 + n;
  };
  auto write = [&](void* p, std::size_t n) {
    const std::uint64_t t = tag_of(p, n);
    std::memcpy(p, &t, 8);
    std::memcpy(static_cast<char*>(p) + n - 8, &t, 8);
  };
  auto check_and_free = [&](void* p, std::size_t n) {
    std::uint64_t head, tail;
    std::memcpy(&head, p, 8);
    std::memcpy(&tail, static_cast<char*>(p) + n - 8, 8);
    EXPECT_EQ(head, tag_of(p, n));
    EXPECT_EQ(tail, tag_of(p, n));
    pool.deallocate(p);
  };
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      std::vector<std::pair<void*, std::size_t>> mine;
      for (int i = 0; i < kOps; ++i) {
        const int action = rng() % 100;
        if (mine.size() < 64 && action < 50) {
          const int k = rng() % 100;
          const std::size_t n = k < 60 ? 16 + rng() % 4096
                                : k < 97 ? 4096 + rng() % (256 * kKiB)
                                         : 1 * kMiB + rng() % (2 * kMiB);
          void* p = pool.allocate(n);
          write(p, n);
          mine.emplace_back(p, n);
          ++allocs[t];
        } else if (!mine.empty() && action < 90) {
          const std::size_t k = rng() % mine.size();
          check_and_free(mine[k].first, mine[k].second);
          mine[k] = mine.back();
          mine.pop_back();
          ++frees[t];
        } else if (!mine.empty() && action < 95) {
          std::lock_guard<std::mutex> lock(mailbox_mu);
          mailbox.push_back(mine.back());
          mine.pop_back();
        } else {
          std::pair<void*, std::size_t> got{nullptr, 0};
          {
            std::lock_guard<std::mutex> lock(mailbox_mu);
            if (!mailbox.empty()) {
              got = mailbox.back();
              mailbox.pop_back();
            }
          }
          if (got.first != nullptr) {
            check_and_free(got.first, got.second);
            ++frees[t];
          }
        }
      }
      for (auto& [p, n] : mine) {
        check_and_free(p, n);
        ++frees[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  std::uint64_t total_frees = 0, total_allocs = 0;
  for (auto& [p, n] : mailbox) check_and_free(p, n);
  for (int t = 0; t < kThreads; ++t) {
    total_allocs += allocs[t];
    total_frees += frees[t];
  }
  total_frees += mailbox.size();
  const PoolStats s = pool.stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.thread_cached_bytes, 0u);  // every worker exited
  EXPECT_EQ(s.num_allocs, total_allocs);
  EXPECT_EQ(s.num_frees, total_frees);
  EXPECT_GT(s.num_cache_hits, total_allocs / 2);
  expect_valid(pool);
  pool.release_cached();
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(dev.used_bytes(), 0u);
}

}  // namespace
}  // namespace mapp
