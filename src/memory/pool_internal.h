// Internal to src/memory: the pool's data structures (Note [Pool policy],
// Note [Thread cache] in include/mapp/memory/pool.h), shared by
//   pool.cc            the public API, the per-thread fast paths and TLS
//   pool_segments.cc   device growth, expandable segments, release, teardown
//   pool_validate.cc   is_valid(), summary(), stats_json()
// The locked path's hot helpers (bins, split/merge, the caches' service) are
// inline here so that allocate/deallocate keep them inlined.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mapp/memory/pool.h"
#include "mapp/memory/trace.h"
#include "ptr_map.h"

namespace mapp {
namespace pool_internal {

// ---- bins (Note [Pool policy] 3) ---------------------------------------------
constexpr int kSubBinBits = 3;                  // 8 bins per power of two
constexpr int kSubBins = 1 << kSubBinBits;
constexpr int kMinShift = 9;                    // 512 B
constexpr int kMaxShift = 50;                   // 1 PiB and up share the top level
constexpr int kNumBins = (kMaxShift - kMinShift + 1) * kSubBins;
constexpr int kBitWords = (kNumBins + 63) / 64;
constexpr int kBinScan = 16;                    // best-fit scan within the request's bin

inline int bin_of(std::size_t size) {
  int fl = 63 - __builtin_clzll(static_cast<unsigned long long>(size));
  if (fl > kMaxShift) fl = kMaxShift;
  const int sl = static_cast<int>((size >> (fl - kSubBinBits)) & (kSubBins - 1));
  return (fl - kMinShift) * kSubBins + sl;
}

inline std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

enum class Kind : std::uint8_t { kSmall = 0, kLarge = 1 };
// kUnmapped: a hole in an expandable segment whose pages were given back.
enum class State : std::uint8_t { kFree, kAllocated, kPending, kUnmapped };

struct Segment;

// 64-aligned, with the fields a thread cache's fast path reads first, so that
// a free touches one cache line of its block (Note [Thread cache]).
struct alignas(64) Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;
  // The PoolThreadCache that owns this allocated block (set and cleared under
  // the mutex); whether it sits in that cache's bins and in which (written by
  // the owning thread).
  std::atomic<void*> owner{nullptr};
  State state = State::kFree;
  std::atomic<bool> cached{false};
  std::int16_t cache_bin = -1;
  int bin = -1;
  std::vector<StreamId> uses;    // other streams (record_stream)
  Segment* seg = nullptr;
  Block* prev = nullptr;   // address neighbours in the segment
  Block* next = nullptr;
  Block* fprev = nullptr;  // links in a free bin
  Block* fnext = nullptr;
  std::vector<EventId> events;   // pending: recorded at deallocate
};

struct FreeIndex {
  Kind kind;
  StreamId stream;
  Block* heads[kNumBins] = {};
  std::uint64_t bits[kBitWords] = {};
  Segment* expandable = nullptr;  // the (kind, stream) expandable segment
};

struct Segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;      // extent tiled by blocks: [base, base + size)
  std::size_t mapped = 0;    // bytes backed by the device (size minus holes)
  std::size_t va = 0;        // reserved address range (expandable)
  bool expandable = false;
  FreeIndex* index = nullptr;
  Block* first = nullptr;
  Block* last = nullptr;
};

// ---- thread caches (Note [Thread cache]) --------------------------------------
constexpr int kCacheDepth = 4;  // cached blocks per bin and thread
// PoolThreadCache::pending: work the owning thread does under the mutex at its
// next operation, which the fast path leaves to the locked path.
enum : std::uint8_t { kFlush = 1, kPeakReset = 2, kCacheOff = 4 };

constexpr auto kRelaxed = std::memory_order_relaxed;

// Single-writer counter update: a plain load and store, no RMW.
[[gnu::always_inline]] inline void bump(std::atomic<std::uint64_t>& a, std::uint64_t delta) {
  a.store(a.load(kRelaxed) + delta, kRelaxed);
}

// "1.50 MiB"
std::string human_bytes(std::uint64_t b);

}  // namespace pool_internal

using namespace pool_internal;  // NOLINT: internal header of src/memory

// One thread's cache for one pool. Bins and `owned` are touched only by the
// owning thread (under the pool's mutex when it is on the locked path); the
// counters are that thread's share of the pool's statistics, read by stats().
struct PoolThreadCache {
  struct Entry {
    std::size_t size;
    std::uintptr_t addr;  // block->addr, one load less before pop() returns
    Block* block;
  };
  struct Bin {
    int n = 0;
    Entry e[kCacheDepth];  // pushed in order; e[0] is evicted first
  };

  PoolThreadCache(CachingPool* p, std::size_t bytes)
      : pool(p),
        pool_id(p->id_),
        limit(bytes),
        max_block(bytes / 2 / CachingPool::kMinBlock * CachingPool::kMinBlock),
        max_last(kLastFreedFactor * bytes),
        bins(static_cast<std::size_t>(bin_of(max_block)) + 1) {}

  // The block freed last may be this many times thread_cache_bytes.
  static constexpr std::size_t kLastFreedFactor = 16;

  CachingPool* const pool;  // valid until `dead`
  const std::uint64_t pool_id;
  const std::size_t limit;      // bytes in the bins at most
  const std::size_t max_block;  // larger blocks never enter the bins
  const std::size_t max_last;   // larger blocks are never cached (nor owned)
  std::vector<Bin> bins;
  internal::PtrMap<Block> owned;  // stream-0 blocks this thread allocated or cached
  std::size_t binned = 0;  // bytes in the bins
  // Shortcuts of the fast path:
  //  * l0: the block freed last, kept outside the bins and their budget (up to
  //    max_last): a same-size free+allocate pair touches no bin;
  //  * the bin of the size asked for last (skips bin_of);
  //  * the block pop() handed out last (a free right after its allocation
  //    skips the hash lookup; push() validates it like any other).
  Entry l0{0, 0, nullptr};
  std::size_t hot_size = 0;
  Bin* hot_bin = nullptr;
  std::uintptr_t hot_addr = 0;
  Block* hot_block = nullptr;
  std::int64_t others = 0;  // the rest of the pool's allocated bytes at the last locked op
  std::atomic<std::uint8_t> pending{0};
  std::atomic<bool> dead{false};  // the pool is gone (set under the retire mutex)
  // This thread's share of the statistics; `allocated` is net and wraps (the
  // pool sums modulo 2^64). Every fast allocation is a cache hit.
  std::atomic<std::uint64_t> allocated{0}, allocs{0}, frees{0}, cached{0}, peak{0};

  // Fast allocation: an exact-size cached block, or nullptr. The fast paths
  // are bound by stores, so each store here is one the statistics or the
  // checks need.
  [[gnu::always_inline]] void* pop(std::size_t bytes) {
    constexpr std::size_t kMin = CachingPool::kMinBlock;
    const std::size_t size = bytes <= kMin ? kMin : (bytes + kMin - 1) & ~(kMin - 1);
    Entry e = l0;
    if (e.block != nullptr && e.size == size) {
      l0.block = nullptr;
    } else {
      if (size > max_block) return nullptr;
      if (size != hot_size) {
        hot_size = size;
        hot_bin = &bins[bin_of(size)];
      }
      Bin& bin = *hot_bin;
      int i = bin.n - 1;
      while (i >= 0 && bin.e[i].size != size) --i;
      if (i < 0) return nullptr;
      e = bin.e[i];
      if (i != --bin.n) bin.e[i] = bin.e[bin.n];  // order only steers eviction
      binned -= size;
    }
    Block* b = e.block;
    b->requested = bytes;
    b->cached.store(false, kRelaxed);
    hot_addr = e.addr;
    hot_block = b;
    bump(allocated, bytes);
    bump(allocs, 1);
    bump(cached, -size);
    const std::int64_t total = static_cast<std::int64_t>(allocated.load(kRelaxed)) + others;
    if (total > static_cast<std::int64_t>(peak.load(kRelaxed))) {
      peak.store(static_cast<std::uint64_t>(total), kRelaxed);
    }
    return reinterpret_cast<void*>(e.addr);
  }

  // Fast free: caches `ptr` if this thread owns its block and there is room.
  // A block owned by a cache is allocated and used on its stream only (frees
  // and record_stream clear the owner), so the owner, address and cached flag
  // are all there is to check. The owner first: once it names this cache,
  // nobody else writes the block; a stale map entry (a block another thread
  // freed) fails there.
  [[gnu::always_inline]] bool push(void* ptr) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    Block* b = addr == hot_addr ? hot_block : owned.find(addr);
    if (b == nullptr || b->owner.load(std::memory_order_acquire) != this || b->addr != addr ||
        b->cached.load(kRelaxed)) {
      return false;
    }
    const std::size_t size = b->size;
    if (l0.block != nullptr) {  // the previous last-freed block moves to its bin
      const std::size_t old = l0.size;
      if (old > max_block || binned + old > limit) return false;
      Bin& bin = bins[l0.block->cache_bin];
      if (bin.n == kCacheDepth) return false;
      bin.e[bin.n++] = l0;
      binned += old;
    }
    l0 = Entry{size, addr, b};
    bump(allocated, -b->requested);  // (a cached block's `requested` is stale)
    bump(frees, 1);
    bump(cached, size);
    b->cached.store(true, kRelaxed);
    return true;
  }

  // Under the mutex: records a stream-0 block this thread just allocated.
  void own(Block* b) {
    if (owned.full()) {  // drop entries of blocks other threads freed
      owned.compact_or_grow([this](std::uintptr_t a, Block* x) {
        return x->owner.load(kRelaxed) == this && x->addr == a;
      });
    }
    owned.insert_or_assign(b->addr, b);
    b->owner.store(this, kRelaxed);
    b->cache_bin = static_cast<std::int16_t>(b->size <= max_block ? bin_of(b->size) : -1);
    if (b->addr == hot_addr) hot_addr = 0;  // (push() would validate it anyway)
  }

  // Thread exit: gives the cache back to its pool, unless the pool is gone.
  void retire() {
    if (!dead.load(std::memory_order_acquire)) pool->retire(this);
  }
};

struct CachingPool::Impl {
  DeviceBackend& dev;
  const PoolOptions& opt;
  DeviceInfo info;
  std::size_t page;
  std::vector<std::unique_ptr<FreeIndex>> indexes;
  std::vector<Segment*> segments;
  internal::PtrMap<Block> live;  // allocated and pending blocks by address
  std::vector<Block*> pending;
  std::vector<Block*> spare_blocks;
  PoolStats st;  // the locked path's share; stats() adds the thread caches'
  std::vector<PoolThreadCache*> caches;  // of live threads
  AllocTraceRecorder* recorder = nullptr;
  const char* grow_failure = "";  // why the last grow() returned nullptr

  Impl(DeviceBackend& d, const PoolOptions& o) : dev(d), opt(o), info(d.query()) {
    page = info.granularity ? info.granularity : (std::size_t(2) << 20);
  }

  // ---- block objects ---------------------------------------------------------
  Block* new_block() {
    if (spare_blocks.empty()) return new Block;
    Block* b = spare_blocks.back();
    spare_blocks.pop_back();
    return b;
  }
  void recycle(Block* b) {
    b->owner.store(nullptr, kRelaxed);
    b->cached.store(false, kRelaxed);
    b->uses.clear();
    b->events.clear();
    b->prev = b->next = b->fprev = b->fnext = nullptr;
    b->bin = -1;
    b->requested = 0;
    spare_blocks.push_back(b);
  }

  // ---- free bins -------------------------------------------------------------
  FreeIndex& index_for(Kind kind, StreamId stream) {
    for (auto& ix : indexes)
      if (ix->kind == kind && ix->stream == stream) return *ix;
    indexes.push_back(std::make_unique<FreeIndex>());
    indexes.back()->kind = kind;
    indexes.back()->stream = stream;
    return *indexes.back();
  }

  void insert_free(Block* b) {
    FreeIndex& ix = *b->seg->index;
    const int bin = bin_of(b->size);
    b->bin = bin;
    b->fprev = nullptr;
    b->fnext = ix.heads[bin];
    if (b->fnext) b->fnext->fprev = b;
    ix.heads[bin] = b;
    ix.bits[bin / 64] |= (std::uint64_t(1) << (bin % 64));
  }

  void remove_free(Block* b) {
    FreeIndex& ix = *b->seg->index;
    if (b->fprev) b->fprev->fnext = b->fnext;
    else ix.heads[b->bin] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    if (ix.heads[b->bin] == nullptr) ix.bits[b->bin / 64] &= ~(std::uint64_t(1) << (b->bin % 64));
    b->fprev = b->fnext = nullptr;
    b->bin = -1;
  }

  static Block* find_fit(FreeIndex& ix, std::size_t size) {
    const int bin = bin_of(size);
    Block* best = nullptr;
    int scanned = 0;
    for (Block* b = ix.heads[bin]; b != nullptr && scanned < kBinScan; b = b->fnext, ++scanned) {
      if (b->size >= size && (best == nullptr || b->size < best->size)) {
        best = b;
        if (b->size == size) break;
      }
    }
    if (best) return best;
    // Any block of a higher bin fits: take the first non-empty one.
    int w = (bin + 1) / 64;
    if (w >= kBitWords) return nullptr;
    std::uint64_t word = ix.bits[w] & (~std::uint64_t(0) << ((bin + 1) % 64));
    while (true) {
      if (word) return ix.heads[w * 64 + __builtin_ctzll(word)];
      if (++w == kBitWords) return nullptr;
      word = ix.bits[w];
    }
  }

  // ---- split / merge ---------------------------------------------------------
  void split(Block* b, std::size_t size, std::size_t min_remainder) {
    if (b->size - size < min_remainder || b->size == size) return;
    Block* rest = new_block();
    rest->addr = b->addr + size;
    rest->size = b->size - size;
    rest->seg = b->seg;
    rest->state = State::kFree;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    else b->seg->last = rest;
    b->next = rest;
    b->size = size;
    insert_free(rest);
  }

  void unlink(Block* b) {  // removes b from its segment's address list
    if (b->prev) b->prev->next = b->next;
    else b->seg->first = b->next;
    if (b->next) b->next->prev = b->prev;
    else b->seg->last = b->prev;
  }

  // Marks b free, merges it with free neighbours, indexes the result.
  Block* free_block(Block* b) {
    b->state = State::kFree;
    b->requested = 0;
    b->uses.clear();
    if (b->prev && b->prev->state == State::kFree) {
      Block* p = b->prev;
      remove_free(p);
      p->size += b->size;
      unlink(b);
      recycle(b);
      b = p;
    }
    if (b->next && b->next->state == State::kFree) {
      Block* n = b->next;
      remove_free(n);
      b->size += n->size;
      unlink(n);
      recycle(n);
    }
    insert_free(b);
    return b;
  }

  void process_pending() {
    auto done = [&](Block* b) {
      for (EventId e : b->events)
        if (!dev.event_done(e)) return false;
      return true;
    };
    for (std::size_t i = 0; i < pending.size();) {
      Block* b = pending[i];
      if (!done(b)) {
        ++i;
        continue;
      }
      for (EventId e : b->events) dev.release_event(e);
      b->events.clear();
      pending[i] = pending.back();
      pending.pop_back();
      live.erase(b->addr);
      st.active_bytes -= b->size;
      --st.num_live_blocks;
      free_block(b);
    }
  }

  // ---- thread caches (Note [Thread cache]) -------------------------------------
  // Returns one cached block of `c` to the pool.
  void give_back(PoolThreadCache* c, Block* b) {
    b->cached.store(false, kRelaxed);
    b->owner.store(nullptr, kRelaxed);
    c->owned.erase(b->addr);
    bump(c->cached, -b->size);
    live.erase(b->addr);
    st.active_bytes -= b->size;
    --st.num_live_blocks;
    free_block(b);
  }

  void give_back_last(PoolThreadCache* c) {
    give_back(c, c->l0.block);
    c->l0.block = nullptr;
  }

  void flush(PoolThreadCache* c) {
    if (c->l0.block != nullptr) give_back_last(c);
    for (PoolThreadCache::Bin& bin : c->bins) {
      for (int i = 0; i < bin.n; ++i) give_back(c, bin.e[i].block);
      bin.n = 0;
    }
    c->binned = 0;
  }

  std::uint64_t allocated_total() const {
    std::uint64_t total = st.allocated_bytes;
    for (const PoolThreadCache* c : caches) total += c->allocated.load(kRelaxed);
    return total;
  }

  // The owning thread, under the mutex: refreshes its view of the pool.
  void sync(PoolThreadCache* c) {
    c->others = static_cast<std::int64_t>(allocated_total() - c->allocated.load(kRelaxed));
  }

  // The owning thread, under the mutex: does what other threads asked for.
  void service(PoolThreadCache* c) {
    const std::uint8_t p = c->pending.load(kRelaxed);
    if (p & kFlush) flush(c);
    if (p & kPeakReset) c->peak.store(0, kRelaxed);
    c->pending.store(p & kCacheOff, kRelaxed);
    sync(c);
  }

  void request(std::uint8_t what, PoolThreadCache* self) {
    for (PoolThreadCache* c : caches)
      if (c != self) c->pending.store(c->pending.load(kRelaxed) | what, kRelaxed);
  }

  bool caches_hold_memory() const {
    for (const PoolThreadCache* c : caches)
      if (c->cached.load(kRelaxed) != 0) return true;
    return false;
  }

  PoolStats merged() const {
    PoolStats s = st;
    s.allocated_bytes = allocated_total();
    for (const PoolThreadCache* c : caches) {
      s.num_allocs += c->allocs.load(kRelaxed);
      s.num_frees += c->frees.load(kRelaxed);
      s.num_cache_hits += c->allocs.load(kRelaxed);
      s.thread_cached_bytes += c->cached.load(kRelaxed);
      if (!(c->pending.load(kRelaxed) & kPeakReset)) {
        s.peak_allocated_bytes = std::max(s.peak_allocated_bytes, c->peak.load(kRelaxed));
      }
    }
    return s;
  }

  // ---- growth, expandable segments, release, teardown (pool_segments.cc) ----
  ~Impl();
  // Unmaps every maximal run of mapped blocks (destruction only).
  void unmap_runs(Segment* s);
  // ---- growth ------------------------------------------------------------------
  void add_reserved(std::size_t bytes);
  Segment* new_segment(FreeIndex& ix, std::uintptr_t base, std::size_t size, bool expandable);
  Block* append_free_block(Segment* s, std::uintptr_t addr, std::size_t size);
  // Returns a free (indexed) block of at least `size`, or nullptr when the
  // device cannot provide the memory.
  Block* grow(FreeIndex& ix, std::size_t size);
  Block* grow_expandable(FreeIndex& ix, std::size_t size);
  void release_cached();
  void drop_reserved(std::size_t bytes);
  // Remaps the hole that, with its free neighbours, best fits `size`.
  Block* map_hole(Segment* s, std::size_t size);
  // Gives back the whole pages inside every free block of an expandable
  // segment: they become holes; a hole at the end shrinks the extent.
  void unmap_free_pages(Segment* s);
  // Splits free block b into [b, lo) free, [lo, hi) hole, [hi, end) free;
  // returns the hole (merged with adjacent holes).
  Block* carve_hole(Segment* s, Block* b, std::uintptr_t lo, std::uintptr_t hi);
  // release_cached() on behalf of the thread owning `self` (may be nullptr).
  void release_all(PoolThreadCache* self);
  std::string oom_message(std::size_t bytes, StreamId stream) const;
};

}  // namespace mapp
