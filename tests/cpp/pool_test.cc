#include "mapp/memory/pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "mapp/memory/trace.h"

namespace mapp {
namespace {

constexpr std::size_t kMiB = std::size_t(1) << 20;

void expect_valid(const CachingPool& pool) {
  std::string why;
  ASSERT_TRUE(pool.is_valid(&why)) << why;
}

PoolOptions expandable() {
  PoolOptions o;
  o.expandable_segments = true;
  o.va_bytes = 1024 * kMiB;
  o.name = "expandable";
  return o;
}

// The same tests run on both segment policies ("same suite, two configs").
class PoolTest : public ::testing::TestWithParam<bool> {
 protected:
  PoolOptions options() const { return GetParam() ? expandable() : PoolOptions::torch_like(); }
};

TEST_P(PoolTest, AlignedUsableAndReused) {
  HostDevice dev;
  CachingPool pool(dev, options());
  void* a = pool.allocate(1000);
  ASSERT_EQ(reinterpret_cast<std::uintptr_t>(a) % CachingPool::kMinBlock, 0u);
  EXPECT_EQ(pool.block_size(a), 1024u);
  std::memset(a, 0xab, 1000);
  pool.deallocate(a);
  void* b = pool.allocate(900);
  EXPECT_EQ(a, b);  // best fit returns the same cached block
  const PoolStats s = pool.stats();
  EXPECT_EQ(s.num_allocs, 2u);
  EXPECT_EQ(s.num_cache_hits, 1u);
  EXPECT_EQ(s.allocated_bytes, 900u);
  EXPECT_EQ(s.peak_allocated_bytes, 1000u);
  pool.deallocate(b);
  EXPECT_THROW(pool.deallocate(b), ValueError);  // double free
  int on_stack = 0;
  EXPECT_THROW(pool.deallocate(&on_stack), ValueError);
  expect_valid(pool);
}

TEST_P(PoolTest, ZeroBytesGivesUniquePointers) {
  HostDevice dev;
  CachingPool pool(dev, options());
  void* a = pool.allocate(0);
  void* b = pool.allocate(0);
  EXPECT_NE(a, b);
  pool.deallocate(a);
  pool.deallocate(b);
  expect_valid(pool);
}

TEST_P(PoolTest, FreeingEverythingCoalescesAndReleases) {
  HostDevice dev;
  CachingPool pool(dev, options());
  std::mt19937 rng(1);
  std::vector<void*> ptrs;
  for (int i = 0; i < 200; ++i) ptrs.push_back(pool.allocate(512 * (1 + rng() % 64)));
  for (int i = 0; i < 20; ++i) ptrs.push_back(pool.allocate(kMiB * (2 + rng() % 12)));
  std::shuffle(ptrs.begin(), ptrs.end(), rng);
  for (void* p : ptrs) {
    pool.deallocate(p);
    expect_valid(pool);
  }
  pool.release_cached();
  expect_valid(pool);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(pool.stats().num_segments, 0u);
  EXPECT_EQ(dev.used_bytes(), 0u);
}

TEST_P(PoolTest, OutOfMemoryIsACleanErrorAndThePoolStaysUsable) {
  HostDevice::Options d;
  d.capacity_bytes = 64 * kMiB;
  HostDevice dev(d);
  PoolOptions o = options();
  o.va_bytes = 64 * kMiB;
  CachingPool pool(dev, o);
  std::vector<void*> ptrs;
  try {
    for (;;) ptrs.push_back(pool.allocate(3 * kMiB));
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos);
  }
  EXPECT_GE(ptrs.size(), 10u);
  EXPECT_EQ(pool.stats().num_ooms, 1u);
  expect_valid(pool);
  for (void* p : ptrs) pool.deallocate(p);
  // Cached memory is released and retried when a different shape needs it.
  void* big = pool.allocate(48 * kMiB);
  EXPECT_GE(pool.stats().num_oom_retries, 1u);
  pool.deallocate(big);
  expect_valid(pool);
}

TEST_P(PoolTest, BlocksStayOnTheirStreamUntilCrossStreamWorkCompletes) {
  HostDevice::Options d;
  d.manual_events = true;
  HostDevice dev(d);
  CachingPool pool(dev, options());
  void* a = pool.allocate(4096, /*stream=*/1);
  pool.deallocate(a);
  void* b = pool.allocate(4096, /*stream=*/2);
  EXPECT_NE(a, b);  // never handed to another stream
  void* c = pool.allocate(4096, /*stream=*/1);
  EXPECT_EQ(a, c);
  pool.record_stream(c, /*stream=*/2);
  pool.deallocate(c);
  void* d2 = pool.allocate(4096, 1);
  EXPECT_NE(d2, c);  // stream 2 may still be using c
  expect_valid(pool);
  dev.complete_events();
  void* e = pool.allocate(4096, 1);
  EXPECT_EQ(e, c);  // released once the recorded event completed
  EXPECT_EQ(dev.live_events(), 0u);
  for (void* p : {b, d2, e}) pool.deallocate(p);
  expect_valid(pool);
}

INSTANTIATE_TEST_SUITE_P(Policies, PoolTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Expandable" : "TorchLike"; });

// ezyang's example: 8 x 16 MiB, free, then 4 x 32 MiB. Plain segments cannot
// merge across segments; an expandable segment reuses the same 128 MiB.
TEST(PoolPolicy, ExpandableSegmentsMergeAcrossGrowth) {
  for (bool exp : {false, true}) {
    HostDevice dev;
    CachingPool pool(dev, exp ? expandable() : PoolOptions::torch_like());
    std::vector<void*> p;
    for (int i = 0; i < 8; ++i) p.push_back(pool.allocate(16 * kMiB));
    for (void* x : p) pool.deallocate(x);
    p.clear();
    for (int i = 0; i < 4; ++i) p.push_back(pool.allocate(32 * kMiB));
    const auto reserved = pool.stats().peak_reserved_bytes;
    if (exp) EXPECT_EQ(reserved, 128 * kMiB);
    else EXPECT_EQ(reserved, 256 * kMiB);
    for (void* x : p) pool.deallocate(x);
    expect_valid(pool);
  }
}

TEST(PoolPolicy, ExpandableSmallAndLargeShareOneSegmentUnlessAskedNot) {
  for (bool separate : {false, true}) {
    HostDevice dev;
    PoolOptions o = expandable();
    o.expandable_small_pool = separate;
    CachingPool pool(dev, o);
    void* small = pool.allocate(4096);
    void* large = pool.allocate(3 * kMiB);
    // Shared: one segment, the small block and the large one side by side in
    // one 4 MiB mapping; separate: two segments of 2 + 4 MiB.
    EXPECT_EQ(pool.stats().num_segments, separate ? 2u : 1u);
    EXPECT_EQ(pool.stats().reserved_bytes, (separate ? 6 : 4) * kMiB);
    pool.deallocate(small);
    pool.deallocate(large);
    pool.release_cached();
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
    expect_valid(pool);
  }
}

TEST(PoolPolicy, GarbageCollectionThresholdReleasesBeforeGrowing) {
  HostDevice::Options d;
  d.capacity_bytes = 100 * kMiB;
  HostDevice dev(d);
  PoolOptions o = PoolOptions::torch_like();
  o.gc_threshold = 0.5;
  CachingPool pool(dev, o);
  pool.deallocate(pool.allocate(20 * kMiB));
  void* b = pool.allocate(40 * kMiB);  // 20 cached + 40 > 50: cache released first
  EXPECT_EQ(pool.stats().reserved_bytes, 40 * kMiB);
  pool.deallocate(b);
  expect_valid(pool);
}

// A million random operations on three streams against a shadow model.
void fuzz(const PoolOptions& options, int ops, unsigned seed) {
  HostDevice::Options d;
  d.capacity_bytes = 512 * kMiB;
  d.manual_events = true;
  HostDevice dev(d);
  PoolOptions o = options;
  o.va_bytes = 0;  // the default reservation (2 x capacity)
  CachingPool pool(dev, o);
  std::mt19937_64 rng(seed);
  struct Live {
    std::size_t size;
    std::uint64_t tag;
  };
  std::map<std::uintptr_t, Live> live;  // shadow: address -> allocation
  std::uint64_t shadow_bytes = 0, shadow_peak = 0, next_tag = 1;
  auto overlaps = [&](std::uintptr_t a, std::size_t n) {
    auto it = live.upper_bound(a);
    if (it != live.end() && it->first < a + std::max<std::size_t>(n, 1)) return true;
    if (it != live.begin()) {
      --it;
      if (it->first + std::max<std::size_t>(it->second.size, 1) > a) return true;
    }
    return false;
  };
  auto draw_size = [&]() -> std::size_t {
    const int kind = rng() % 100;
    if (kind < 70) return rng() % 4096;                  // small tensors
    if (kind < 97) return 4096 + rng() % (2 * kMiB);     // activations
    return 8 * kMiB + rng() % (24 * kMiB);               // big buffers
  };
  for (int i = 0; i < ops; ++i) {
    const int action = rng() % 100;
    const bool must_free = live.size() >= 256;  // keep the working set bounded
    if (!must_free && (action < 50 || live.empty())) {
      const std::size_t n = draw_size();
      const StreamId stream = rng() % 3;
      void* p = nullptr;
      try {
        p = pool.allocate(n, stream);
      } catch (const OutOfMemoryError&) {
        ASSERT_GT(shadow_bytes + n, d.capacity_bytes / 2) << "OOM far below capacity";
        continue;
      }
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      ASSERT_EQ(a % CachingPool::kMinBlock, 0u);
      ASSERT_FALSE(overlaps(a, n)) << "live blocks overlap at op " << i;
      const std::uint64_t tag = next_tag++;
      if (n >= 16) {  // head and tail words, not overlapping
        std::memcpy(p, &tag, 8);
        std::memcpy(static_cast<char*>(p) + n - 8, &tag, 8);
      }
      live[a] = {n, tag};
      shadow_bytes += n;
      shadow_peak = std::max(shadow_peak, shadow_bytes);
      if (rng() % 10 == 0) pool.record_stream(p, rng() % 3);
    } else if (must_free || action < 97) {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      void* p = reinterpret_cast<void*>(it->first);
      if (it->second.size >= 16) {  // nobody else wrote into this block
        std::uint64_t head, tail;
        std::memcpy(&head, p, 8);
        std::memcpy(&tail, static_cast<char*>(p) + it->second.size - 8, 8);
        ASSERT_EQ(head, it->second.tag);
        ASSERT_EQ(tail, it->second.tag);
      }
      pool.deallocate(p);
      shadow_bytes -= it->second.size;
      live.erase(it);
    } else if (action < 99) {
      dev.complete_events();
    } else {
      pool.release_cached();
    }
    // The full walk is 80% of the run: every op for the first 100k, then
    // every 16th and after every event completion or release (a broken
    // invariant persists, so it is still caught within 16 ops). The
    // allocation counters below are checked at every op.
    if (i < 100000 || i % 16 == 0 || action >= 97) {
      std::string why;
      ASSERT_TRUE(pool.is_valid(&why)) << "op " << i << ": " << why;
    }
    const PoolStats st = pool.stats();
    ASSERT_EQ(st.allocated_bytes, shadow_bytes) << "op " << i;
    ASSERT_EQ(st.peak_allocated_bytes, shadow_peak) << "op " << i;
  }
  for (auto& [a, l] : live) pool.deallocate(reinterpret_cast<void*>(a));
  dev.complete_events();
  pool.release_cached();
  std::string why;
  ASSERT_TRUE(pool.is_valid(&why)) << why;
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(dev.used_bytes(), 0u);
}

TEST(PoolFuzz, MillionOperationsTorchLike) { fuzz(PoolOptions::torch_like(), 1000000, 7); }
TEST(PoolFuzz, MillionOperationsExpandable) { fuzz(expandable(), 1000000, 8); }
TEST(PoolFuzz, MillionOperationsExpandableSeparateSmallPool) {
  PoolOptions o = expandable();
  o.expandable_small_pool = true;
  fuzz(o, 1000000, 9);
}
// Note [Thread cache]: one thread, so the peak stays exact. The CPU pool's
// default cache: bins take blocks up to 512 KiB, the last freed one up to
// 16 MiB; the fuzz's sizes reach 32 MiB, on three streams.
TEST(PoolFuzz, MillionOperationsExpandableThreadCache) {
  PoolOptions o = expandable();
  o.thread_cache_bytes = PoolOptions::kDefaultThreadCacheBytes;
  fuzz(o, 1000000, 10);
}
TEST(PoolFuzz, QuarterMillionOperationsTorchLikeThreadCache) {
  PoolOptions o = PoolOptions::torch_like();
  o.thread_cache_bytes = 64 * 1024;
  fuzz(o, 250000, 11);
}

// ---- traces -------------------------------------------------------------------

AllocTrace record_some(CachingPool& pool) {
  AllocTraceRecorder rec;
  pool.set_recorder(&rec);
  std::mt19937 rng(3);
  std::vector<void*> live;
  for (int i = 0; i < 2000; ++i) {
    if (live.empty() || rng() % 2) {
      live.push_back(pool.allocate(rng() % (3 * kMiB), rng() % 2));
      if (rng() % 7 == 0) pool.record_stream(live.back(), 5);
    } else {
      const std::size_t k = rng() % live.size();
      pool.deallocate(live[k]);
      live.erase(live.begin() + static_cast<long>(k));
    }
    if (i == 1000) pool.release_cached();
  }
  for (void* p : live) pool.deallocate(p);
  pool.set_recorder(nullptr);
  return rec.trace();
}

TEST(AllocTraceTest, RoundTripsAndReplaysDeterministically) {
  HostDevice dev;
  CachingPool pool(dev, expandable());
  const AllocTrace t = record_some(pool);
  ASSERT_GT(t.events.size(), 2000u);
  const AllocTrace back = AllocTrace::decode(t.encode());
  ASSERT_EQ(back.events.size(), t.events.size());
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    EXPECT_EQ(back.events[i].op, t.events[i].op);
    EXPECT_EQ(back.events[i].id, t.events[i].id);
    EXPECT_EQ(back.events[i].size, t.events[i].size);
    EXPECT_EQ(back.events[i].stream, t.events[i].stream);
  }
  HostDevice d1, d2;
  const ReplayResult r1 = replay(back, d1, expandable());
  const ReplayResult r2 = replay(back, d2, expandable());
  EXPECT_EQ(r1.operations, t.events.size());
  EXPECT_EQ(r1.stats.peak_reserved_bytes, r2.stats.peak_reserved_bytes);
  EXPECT_EQ(r1.stats.peak_allocated_bytes, pool.stats().peak_allocated_bytes);
  EXPECT_EQ(r1.stats.num_device_allocs, r2.stats.num_device_allocs);
}

TEST(AllocTraceTest, MalformedInputIsRejectedWithTheOffset) {
  AllocTrace t;
  t.events.push_back({TraceOp::kAlloc, 0, 100, 0});
  t.events.push_back({TraceOp::kFree, 0, 0, 0});
  const std::string good = t.encode();
  auto rejects = [](const std::string& bytes, const char* part) {
    try {
      AllocTrace::decode(bytes);
      ADD_FAILURE() << "accepted malformed trace expecting '" << part << "'";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  rejects("not a trace at all", "MAPPTRC1");
  rejects(good.substr(0, good.size() - 1), "truncated");
  rejects(good + "x", "unexpected bytes");
  std::string bad_op = good;
  bad_op[16] = 9;
  rejects(bad_op, "unknown op 9");
  AllocTrace unknown;
  unknown.events.push_back({TraceOp::kFree, 42, 0, 0});
  rejects(unknown.encode(), "id 42");
  std::string huge = good;
  huge[15] = 0x7f;  // event count far beyond the file size
  rejects(huge, "claims");
}

}  // namespace
}  // namespace mapp
