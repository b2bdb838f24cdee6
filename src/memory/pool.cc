#include "mapp/memory/pool.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <sstream>
#include <utility>

#include "mapp/memory/trace.h"
#include "ptr_map.h"

namespace mapp {
namespace {

// ---- bins (Note [Pool policy] 3) ---------------------------------------------
constexpr int kSubBinBits = 3;                  // 8 bins per power of two
constexpr int kSubBins = 1 << kSubBinBits;
constexpr int kMinShift = 9;                    // 512 B
constexpr int kMaxShift = 50;                   // 1 PiB and up share the top level
constexpr int kNumBins = (kMaxShift - kMinShift + 1) * kSubBins;
constexpr int kBitWords = (kNumBins + 63) / 64;
constexpr int kBinScan = 16;                    // best-fit scan within the request's bin

int bin_of(std::size_t size) {
  int fl = 63 - __builtin_clzll(static_cast<unsigned long long>(size));
  if (fl > kMaxShift) fl = kMaxShift;
  const int sl = static_cast<int>((size >> (fl - kSubBinBits)) & (kSubBins - 1));
  return (fl - kMinShift) * kSubBins + sl;
}

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

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

std::string human_bytes(std::uint64_t b) {
  char buf[32];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace

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

namespace {

// This thread's cache of the pool it used last: one compare on the fast path.
// initial-exec (CMake MAPP_INITIAL_EXEC_TLS, default ON): a fixed offset from
// the thread pointer, no __tls_get_addr call.
#if !defined(MAPP_INITIAL_EXEC_TLS) || MAPP_INITIAL_EXEC_TLS
#define MAPP_TLS_MODEL __attribute__((tls_model("initial-exec")))
#else
#define MAPP_TLS_MODEL
#endif
struct TlsSlot {
  std::uint64_t pool_id;
  PoolThreadCache* cache;
  bool exiting;  // the thread's caches are gone; later operations take the lock
};
thread_local TlsSlot tls_slot MAPP_TLS_MODEL = {0, nullptr, false};

std::mutex g_retire_mu;  // orders thread exit against pool destruction
std::atomic<std::uint64_t> g_next_pool_id{1};

struct TlsCaches {
  std::vector<std::unique_ptr<PoolThreadCache>> all;
  ~TlsCaches() {
    tls_slot = {0, nullptr, true};
    std::lock_guard<std::mutex> lock(g_retire_mu);
    for (auto& c : all) c->retire();
  }
};
thread_local TlsCaches tls_caches;

}  // namespace

PoolOptions PoolOptions::torch_like() {
  PoolOptions o;
  o.expandable_segments = false;
  o.large_split_remainder = (std::size_t(1) << 20) + 1;  // torch: split large if rest > 1 MiB
  o.expandable_small_pool = true;  // torch keeps its small pool apart in either mode
  o.name = "torch-like";
  return o;
}

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

  ~Impl() {
    for (Block* b : pending)
      for (EventId e : b->events) dev.release_event(e);
    for (Segment* s : segments) {
      if (s->expandable) unmap_runs(s);
      for (Block* b = s->first; b != nullptr;) {
        Block* n = b->next;
        delete b;
        b = n;
      }
      if (s->expandable) {
        dev.unreserve(reinterpret_cast<void*>(s->base), s->va);
      } else {
        dev.release(reinterpret_cast<void*>(s->base), s->size);
      }
      delete s;
    }
    for (Block* b : spare_blocks) delete b;
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

  // Unmaps every maximal run of mapped blocks (destruction only).
  void unmap_runs(Segment* s) {
    std::uintptr_t run = 0;
    for (Block* b = s->first; b != nullptr; b = b->next) {
      if (b->state != State::kUnmapped && run == 0) run = b->addr;
      const bool ends = b->next == nullptr || b->next->state == State::kUnmapped;
      if (b->state != State::kUnmapped && ends) {
        dev.unmap(reinterpret_cast<void*>(run), b->addr + b->size - run);
        run = 0;
      }
    }
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

  // ---- growth ------------------------------------------------------------------
  void add_reserved(std::size_t bytes) {
    st.reserved_bytes += bytes;
    st.peak_reserved_bytes = std::max(st.peak_reserved_bytes, st.reserved_bytes);
    ++st.num_device_allocs;
  }

  Segment* new_segment(FreeIndex& ix, std::uintptr_t base, std::size_t size, bool expandable) {
    auto* s = new Segment;
    s->base = base;
    s->size = size;
    s->mapped = size;
    s->expandable = expandable;
    s->index = &ix;
    segments.push_back(s);
    ++st.num_segments;
    return s;
  }

  Block* append_free_block(Segment* s, std::uintptr_t addr, std::size_t size) {
    Block* b = new_block();
    b->addr = addr;
    b->size = size;
    b->seg = s;
    b->state = State::kFree;
    b->prev = s->last;
    if (s->last) s->last->next = b;
    else s->first = b;
    s->last = b;
    insert_free(b);
    return b;
  }

  // Returns a free (indexed) block of at least `size`, or nullptr when the
  // device cannot provide the memory.
  Block* grow(FreeIndex& ix, std::size_t size) {
    if (opt.expandable_segments) return grow_expandable(ix, size);
    std::size_t seg_size;
    if (ix.kind == Kind::kSmall) seg_size = opt.small_segment;
    else if (size < opt.min_large_alloc) seg_size = opt.large_segment;
    else seg_size = round_up(size, opt.round_large);
    seg_size = std::max(seg_size, size);
    void* p = dev.allocate(seg_size);
    if (p == nullptr) {
      grow_failure = "the device is out of memory";
      return nullptr;
    }
    add_reserved(seg_size);
    Segment* s = new_segment(ix, reinterpret_cast<std::uintptr_t>(p), seg_size, false);
    return append_free_block(s, s->base, seg_size);
  }

  Block* grow_expandable(FreeIndex& ix, std::size_t size) {
    Segment* s = ix.expandable;
    if (s == nullptr) {
      // Default: twice the capacity, so that the extent can creep past
      // long-lived blocks near its end while holes below are remapped.
      const std::size_t va = round_up(opt.va_bytes ? opt.va_bytes : 2 * info.total_bytes, page);
      void* base = dev.reserve(va);
      if (base == nullptr) {
        grow_failure = "reserving the expandable segment's address range failed";
        return nullptr;
      }
      s = new_segment(ix, reinterpret_cast<std::uintptr_t>(base), 0, true);
      s->va = va;
      ix.expandable = s;
    }
    if (Block* b = map_hole(s, size)) return b;
    Block* tail = (s->last && s->last->state == State::kFree) ? s->last : nullptr;
    if (tail && tail->size >= size) return tail;  // the bounded bin scan missed it
    const std::size_t have = tail ? tail->size : 0;
    const std::size_t need = round_up(size - have, page);
    if (s->size + need > s->va) {
      grow_failure = "the expandable segment's address range (va_bytes) is exhausted";
      return nullptr;
    }
    if (!dev.map(reinterpret_cast<void*>(s->base + s->size), need)) {
      grow_failure = "the device is out of memory";
      return nullptr;
    }
    add_reserved(need);
    const std::uintptr_t at = s->base + s->size;
    s->size += need;
    s->mapped += need;
    if (tail) {
      remove_free(tail);
      tail->size += need;
      insert_free(tail);
      return tail;
    }
    return append_free_block(s, at, need);
  }

  void release_cached() {
    process_pending();
    std::vector<Segment*> keep;
    for (Segment* s : segments) {
      if (!s->expandable) {
        if (s->first == s->last && s->first->state == State::kFree) {
          remove_free(s->first);
          recycle(s->first);
          dev.release(reinterpret_cast<void*>(s->base), s->size);
          drop_reserved(s->size);
          --st.num_segments;
          delete s;
          continue;
        }
      } else {
        unmap_free_pages(s);
        if (s->size == 0) {
          dev.unreserve(reinterpret_cast<void*>(s->base), s->va);
          s->index->expandable = nullptr;
          --st.num_segments;
          delete s;
          continue;
        }
      }
      keep.push_back(s);
    }
    segments.swap(keep);
  }

  void drop_reserved(std::size_t bytes) {
    st.reserved_bytes -= bytes;
    ++st.num_device_frees;
  }

  // Remaps the hole that, with its free neighbours, best fits `size`.
  Block* map_hole(Segment* s, std::size_t size) {
    Block* best = nullptr;
    std::size_t best_avail = 0;
    for (Block* b = s->first; b != nullptr; b = b->next) {
      if (b->state != State::kUnmapped) continue;
      std::size_t avail = b->size;
      if (b->prev && b->prev->state == State::kFree) avail += b->prev->size;
      if (b->next && b->next->state == State::kFree) avail += b->next->size;
      if (avail >= size && (best == nullptr || avail < best_avail)) {
        best = b;
        best_avail = avail;
      }
    }
    if (best == nullptr) return nullptr;
    if (!dev.map(reinterpret_cast<void*>(best->addr), best->size)) {
      grow_failure = "the device is out of memory";
      return nullptr;
    }
    add_reserved(best->size);
    s->mapped += best->size;
    return free_block(best);
  }

  // Gives back the whole pages inside every free block of an expandable
  // segment: they become holes; a hole at the end shrinks the extent.
  void unmap_free_pages(Segment* s) {
    for (Block* b = s->first; b != nullptr; b = b->next) {
      if (b->state == State::kFree) {
        const std::uintptr_t lo = s->base + round_up(b->addr - s->base, page);
        const std::uintptr_t hi = s->base + (b->addr + b->size - s->base) / page * page;
        if (lo < hi) b = carve_hole(s, b, lo, hi);  // continue after the (merged) hole
      }
    }
    if (s->last && s->last->state == State::kUnmapped) {
      Block* t = s->last;
      s->size = t->addr - s->base;
      unlink(t);
      recycle(t);
    }
  }

  // Splits free block b into [b, lo) free, [lo, hi) hole, [hi, end) free;
  // returns the hole (merged with adjacent holes).
  Block* carve_hole(Segment* s, Block* b, std::uintptr_t lo, std::uintptr_t hi) {
    remove_free(b);
    dev.unmap(reinterpret_cast<void*>(lo), hi - lo);
    drop_reserved(hi - lo);
    s->mapped -= hi - lo;
    const std::uintptr_t end = b->addr + b->size;
    auto insert_after = [&](Block* at, std::uintptr_t addr, std::size_t size, State state) {
      Block* n = new_block();
      n->addr = addr;
      n->size = size;
      n->seg = s;
      n->state = state;
      n->prev = at;
      n->next = at->next;
      if (at->next) at->next->prev = n;
      else s->last = n;
      at->next = n;
      return n;
    };
    Block* hole = b;
    if (lo > b->addr) {  // keep a free head
      b->size = lo - b->addr;
      insert_free(b);
      hole = insert_after(b, lo, hi - lo, State::kUnmapped);
    } else {
      b->state = State::kUnmapped;
      b->size = hi - lo;
    }
    if (hi < end) insert_free(insert_after(hole, hi, end - hi, State::kFree));
    // Holes next to holes (a block freed beside an earlier hole) merge.
    if (hole->next && hole->next->state == State::kUnmapped) {
      Block* n = hole->next;
      hole->size += n->size;
      unlink(n);
      recycle(n);
    }
    if (hole->prev && hole->prev->state == State::kUnmapped) {
      Block* p = hole->prev;
      p->size += hole->size;
      unlink(hole);
      recycle(hole);
      hole = p;
    }
    return hole;
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

  // release_cached() on behalf of the thread owning `self` (may be nullptr).
  void release_all(PoolThreadCache* self) {
    if (self) flush(self);
    request(kFlush, self);
    release_cached();
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

  std::string oom_message(std::size_t bytes, StreamId stream) const {
    const DeviceInfo now = dev.query();
    std::ostringstream os;
    os << "out of memory: pool '" << opt.name << "' could not allocate " << human_bytes(bytes)
       << " on stream " << stream << ": " << grow_failure << " (" << dev.name() << " capacity "
       << human_bytes(now.total_bytes) << ", free " << human_bytes(now.free_bytes)
       << "; pool reserved " << human_bytes(st.reserved_bytes) << ", allocated "
       << human_bytes(allocated_total()) << " after releasing its cache). Reduce the batch "
       << "or model size, or free tensors you no longer need";
    return os.str();
  }
};

CachingPool::CachingPool(DeviceBackend& device, PoolOptions options)
    : options_(std::move(options)),
      impl_(new Impl(device, options_)),
      id_(g_next_pool_id.fetch_add(1)) {
  MAPP_CHECK(options_.thread_cache_bytes == 0 || options_.thread_cache_bytes >= 2 * kMinBlock,
             "thread_cache_bytes must be 0 (off) or at least ", 2 * kMinBlock, ", got ",
             options_.thread_cache_bytes);
  MAPP_CHECK(options_.small_segment >= options_.small_size,
             "small_segment (", options_.small_segment, ") must hold a small_size (",
             options_.small_size, ") request");
  MAPP_CHECK(options_.small_split_remainder >= kMinBlock &&
                 options_.large_split_remainder >= kMinBlock,
             "split remainders must be at least ", kMinBlock, " bytes");
  MAPP_CHECK(options_.gc_threshold >= 0.0 && options_.gc_threshold <= 1.0,
             "gc_threshold must lie in [0, 1], got ", options_.gc_threshold);
  if (options_.expandable_segments) {
    MAPP_CHECK(impl_->info.supports_virtual, "expandable segments need virtual memory, which the ",
               device.name(), " backend does not support; use expandable_segments=false");
  }
}

CachingPool::~CachingPool() {
  // Caches of threads still running outlive the pool in their thread's storage;
  // they are marked dead and never touched again (ids are not reused).
  std::lock_guard<std::mutex> retire(g_retire_mu);
  std::lock_guard<std::mutex> lock(mu_);
  for (PoolThreadCache* c : impl_->caches) c->dead.store(true, std::memory_order_release);
}

PoolThreadCache* CachingPool::thread_cache(bool create) {
  TlsSlot& slot = tls_slot;
  if (slot.pool_id == id_) return slot.cache;
  if (options_.thread_cache_bytes == 0 || slot.exiting) return nullptr;
  auto& all = tls_caches.all;
  all.erase(std::remove_if(all.begin(), all.end(),
                           [](const auto& c) { return c->dead.load(std::memory_order_acquire); }),
            all.end());
  PoolThreadCache* found = nullptr;
  for (const auto& c : all)
    if (c->pool_id == id_) found = c.get();
  if (found == nullptr && create) {
    auto c = std::make_unique<PoolThreadCache>(this, options_.thread_cache_bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (impl_->recorder) c->pending.store(kCacheOff, kRelaxed);
      impl_->caches.push_back(c.get());
      impl_->sync(c.get());
    }
    found = c.get();
    all.push_back(std::move(c));
  }
  if (found != nullptr) slot = {id_, found, false};
  return found;
}

void CachingPool::retire(PoolThreadCache* c) {
  std::lock_guard<std::mutex> lock(mu_);
  Impl& m = *impl_;
  m.flush(c);
  c->owned.for_each([c](std::uintptr_t, Block* b) {
    if (b->owner.load(kRelaxed) == c) b->owner.store(nullptr, kRelaxed);
  });
  // Its share of the statistics moves to the locked path's.
  const PoolStats before = m.merged();
  m.st.allocated_bytes += c->allocated.load(kRelaxed);
  m.st.num_allocs += c->allocs.load(kRelaxed);
  m.st.num_frees += c->frees.load(kRelaxed);
  m.st.num_cache_hits += c->allocs.load(kRelaxed);
  m.st.peak_allocated_bytes = before.peak_allocated_bytes;
  m.caches.erase(std::find(m.caches.begin(), m.caches.end(), c));
}

// The fast paths below are one TLS compare plus the cache's pop/push; all else
// is out of line, so that the hit needs no stack frame.
void* CachingPool::allocate(std::size_t bytes, StreamId stream) {
  const TlsSlot& slot = tls_slot;
  if (slot.pool_id == id_ && stream == 0) {
    PoolThreadCache* c = slot.cache;
    if (c->pending.load(kRelaxed) == 0 && bytes <= c->max_last) {
      if (void* p = c->pop(bytes)) return p;
    }
  }
  return allocate_slow(bytes, stream);
}

void* CachingPool::allocate_slow(std::size_t bytes, StreamId stream) {
  const bool tried = tls_slot.pool_id == id_;  // allocate() already tried the cache
  // Any stream: the locked path refreshes the cache's view of the pool.
  PoolThreadCache* c = options_.thread_cache_bytes != 0 ? thread_cache(true) : nullptr;
  if (!tried && c != nullptr && stream == 0 && c->pending.load(kRelaxed) == 0 &&
      bytes <= c->max_last) {
    if (void* p = c->pop(bytes)) return p;  // this thread's cache, just looked up
  }
  std::lock_guard<std::mutex> lock(mu_);
  return allocate_locked(bytes, stream, c);
}

void* CachingPool::allocate_locked(std::size_t bytes, StreamId stream, PoolThreadCache* c) {
  Impl& m = *impl_;
  if (c != nullptr && c->pending.load(kRelaxed) != 0) m.service(c);
  const std::size_t size = std::max(round_up(bytes, kMinBlock), kMinBlock);
  MAPP_CHECK(size >= bytes, "allocation of ", bytes, " bytes overflows");
  if (!m.pending.empty()) m.process_pending();
  const bool split_pools = !options_.expandable_segments || options_.expandable_small_pool;
  const Kind kind = split_pools && size <= options_.small_size ? Kind::kSmall : Kind::kLarge;
  FreeIndex& ix = m.index_for(kind, stream);
  Block* b = Impl::find_fit(ix, size);
  if (b == nullptr && m.caches_hold_memory()) {
    // Thread caches never make the pool grow: cached blocks go back first
    // (this thread's now, the others' at their next operation).
    if (c != nullptr) m.flush(c);
    m.request(kFlush, c);
    b = Impl::find_fit(ix, size);
  }
  if (b != nullptr) {
    ++m.st.num_cache_hits;
  } else {
    if (options_.gc_threshold > 0.0 &&
        m.st.reserved_bytes + size > options_.gc_threshold * m.info.total_bytes) {
      m.release_all(c);
    }
    b = m.grow(ix, size);
    if (b == nullptr) {
      ++m.st.num_oom_retries;
      m.release_all(c);
      b = m.grow(ix, size);
    }
    if (b == nullptr) {
      ++m.st.num_ooms;
      throw OutOfMemoryError(m.oom_message(bytes, stream));
    }
  }
  m.remove_free(b);
  m.split(b, size, kind == Kind::kSmall ? options_.small_split_remainder
                                        : options_.large_split_remainder);
  b->state = State::kAllocated;
  b->requested = bytes;
  m.live.insert(b->addr, b);
  if (c != nullptr && stream == 0 && b->size <= c->max_last) c->own(b);
  PoolStats& st = m.st;
  st.allocated_bytes += bytes;
  st.peak_allocated_bytes = std::max(st.peak_allocated_bytes, m.allocated_total());
  st.active_bytes += b->size;
  st.peak_active_bytes = std::max(st.peak_active_bytes, st.active_bytes);
  ++st.num_allocs;
  ++st.num_live_blocks;
  if (c != nullptr) m.sync(c);
  void* p = reinterpret_cast<void*>(b->addr);
  if (m.recorder) m.recorder->on_alloc(p, bytes, stream);
  return p;
}

void CachingPool::deallocate(void* ptr) {
  const TlsSlot& slot = tls_slot;
  if (slot.pool_id == id_) {
    PoolThreadCache* c = slot.cache;
    if (c->pending.load(kRelaxed) == 0 && c->push(ptr)) return;
  }
  deallocate_slow(ptr);
}

void CachingPool::deallocate_slow(void* ptr) {
  const bool tried = tls_slot.pool_id == id_;  // deallocate() already tried the cache
  PoolThreadCache* c = options_.thread_cache_bytes != 0 ? thread_cache(false) : nullptr;
  if (!tried && c != nullptr && c->pending.load(kRelaxed) == 0 && c->push(ptr)) return;
  std::lock_guard<std::mutex> lock(mu_);
  deallocate_locked(ptr, c);
}

void CachingPool::deallocate_locked(void* ptr, PoolThreadCache* c) {
  Impl& m = *impl_;
  if (c != nullptr && c->pending.load(kRelaxed) != 0) m.service(c);
  Block* b = m.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  MAPP_CHECK(b != nullptr && b->state == State::kAllocated && !b->cached.load(kRelaxed),
             "pointer ", ptr, " was not allocated by pool '", options_.name,
             "' or was already freed");
  if (m.recorder) m.recorder->on_free(ptr);
  void* owner = b->owner.load(kRelaxed);
  if (c != nullptr && owner == c && b->uses.empty() && c->pending.load(kRelaxed) == 0) {
    // This thread's block, but the block freed before it fits no bin (too
    // large, bin full, budget spent): that one goes back to the pool instead.
    if (c->l0.block != nullptr) m.give_back_last(c);
    const bool cached = c->push(ptr);
    MAPP_CHECK_STATE(cached, "thread cache refused block ", ptr, " after making room");
    m.sync(c);
    return;
  }
  if (owner != nullptr) {
    if (owner == c) c->owned.erase(b->addr);
    b->owner.store(nullptr, kRelaxed);
  }
  m.st.allocated_bytes -= b->requested;
  b->requested = 0;
  ++m.st.num_frees;
  if (c != nullptr) m.sync(c);
  if (!b->uses.empty()) {
    for (StreamId s : b->uses) b->events.push_back(m.dev.record_event(s));
    b->uses.clear();
    b->state = State::kPending;
    m.pending.push_back(b);
    return;
  }
  m.live.erase(b->addr);
  m.st.active_bytes -= b->size;
  --m.st.num_live_blocks;
  m.free_block(b);
}

void CachingPool::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Impl& m = *impl_;
  Block* b = m.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  MAPP_CHECK(b != nullptr && b->state == State::kAllocated && !b->cached.load(kRelaxed),
             "record_stream: pointer ", ptr, " is not a live allocation of pool '",
             options_.name, "'");
  if (m.recorder) m.recorder->on_record_stream(ptr, stream);
  if (stream == b->seg->index->stream) return;
  if (std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
  // Thread caches take only blocks used on their own stream: the owner's next
  // free of it takes the locked path (its map entry goes stale).
  b->owner.store(nullptr, kRelaxed);
}

void CachingPool::release_cached() {
  PoolThreadCache* c = thread_cache(false);
  std::lock_guard<std::mutex> lock(mu_);
  if (impl_->recorder) impl_->recorder->on_release_cached();
  impl_->release_all(c);
}

std::size_t CachingPool::block_size(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = impl_->live.find(reinterpret_cast<std::uintptr_t>(ptr));
  MAPP_CHECK(b != nullptr && !b->cached.load(kRelaxed), "pointer ", ptr,
             " is not a live allocation of this pool");
  return b->size;
}

bool CachingPool::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Block* b = impl_->live.find(reinterpret_cast<std::uintptr_t>(ptr));
  return b != nullptr && !b->cached.load(kRelaxed);
}

PoolStats CachingPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return impl_->merged();
}

void CachingPool::reset_peak_stats() {
  PoolThreadCache* c = thread_cache(false);
  std::lock_guard<std::mutex> lock(mu_);
  Impl& m = *impl_;
  PoolStats& st = m.st;
  st.peak_allocated_bytes = m.allocated_total();
  st.peak_active_bytes = st.active_bytes;
  st.peak_reserved_bytes = st.reserved_bytes;
  // Thread caches' peaks restart at their next operation (stats() ignores them
  // until then); the caller's own at once.
  m.request(kPeakReset, c);
  if (c != nullptr) c->peak.store(0, kRelaxed);
}

void CachingPool::set_recorder(AllocTraceRecorder* recorder) {
  PoolThreadCache* c = thread_cache(false);
  std::lock_guard<std::mutex> lock(mu_);
  Impl& m = *impl_;
  m.recorder = recorder;
  // A trace must see every operation: caches empty themselves and stay off.
  for (PoolThreadCache* t : m.caches) {
    const std::uint8_t p = t->pending.load(kRelaxed);
    t->pending.store(recorder ? (p | kCacheOff | kFlush) : (p & ~kCacheOff), kRelaxed);
  }
  if (c != nullptr) m.service(c);
}

std::string CachingPool::summary() const {
  const PoolStats s = stats();
  std::ostringstream os;
  const double hit = s.num_allocs ? 100.0 * s.num_cache_hits / s.num_allocs : 0.0;
  os << "memory pool '" << options_.name << "' on " << impl_->dev.name() << " ("
     << (options_.expandable_segments ? "expandable segments" : "plain segments") << ")\n"
     << "  allocated " << human_bytes(s.allocated_bytes) << " (peak "
     << human_bytes(s.peak_allocated_bytes) << "), active " << human_bytes(s.active_bytes)
     << ", reserved " << human_bytes(s.reserved_bytes) << " (peak "
     << human_bytes(s.peak_reserved_bytes) << ")\n";
  char frag[64];
  std::snprintf(frag, sizeof(frag), "%.2f%%", 100.0 * s.fragmentation());
  char hits[32];
  std::snprintf(hits, sizeof(hits), "%.1f%%", hit);
  os << "  fragmentation (1 - peak allocated / peak reserved) " << frag << "\n"
     << "  " << s.num_allocs << " allocs, " << s.num_frees << " frees, cache hits " << hits
     << ", device allocs " << s.num_device_allocs << ", device frees " << s.num_device_frees
     << ", OOM retries " << s.num_oom_retries << ", OOMs " << s.num_ooms << ", segments "
     << s.num_segments << ", live blocks " << s.num_live_blocks << "\n";
  if (options_.thread_cache_bytes != 0) {
    os << "  thread caches (" << human_bytes(options_.thread_cache_bytes) << " per thread) hold "
       << human_bytes(s.thread_cached_bytes) << "\n";
  }
  return os.str();
}

std::string CachingPool::stats_json() const {
  const PoolStats s = stats();
  std::ostringstream os;
  os << "{\"name\":\"" << options_.name << "\",\"backend\":\"" << impl_->dev.name()
     << "\",\"expandable_segments\":" << (options_.expandable_segments ? "true" : "false")
     << ",\"allocated_bytes\":" << s.allocated_bytes
     << ",\"peak_allocated_bytes\":" << s.peak_allocated_bytes
     << ",\"active_bytes\":" << s.active_bytes << ",\"peak_active_bytes\":" << s.peak_active_bytes
     << ",\"reserved_bytes\":" << s.reserved_bytes
     << ",\"peak_reserved_bytes\":" << s.peak_reserved_bytes << ",\"num_allocs\":" << s.num_allocs
     << ",\"num_frees\":" << s.num_frees << ",\"num_cache_hits\":" << s.num_cache_hits
     << ",\"num_device_allocs\":" << s.num_device_allocs
     << ",\"num_device_frees\":" << s.num_device_frees
     << ",\"num_oom_retries\":" << s.num_oom_retries << ",\"num_ooms\":" << s.num_ooms
     << ",\"num_segments\":" << s.num_segments << ",\"num_live_blocks\":" << s.num_live_blocks
     << ",\"thread_cached_bytes\":" << s.thread_cached_bytes
     << ",\"fragmentation\":" << s.fragmentation() << "}";
  return os.str();
}

bool CachingPool::is_valid(std::string* why) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Impl& m = *impl_;
  auto fail = [&](const std::string& msg) {
    if (why) *why = msg;
    return false;
  };
  std::uint64_t allocated = 0, active = 0, reserved = 0, live_blocks = 0, free_blocks = 0;
  for (const Segment* s : m.segments) {
    reserved += s->mapped;
    std::size_t holes = 0;
    std::uintptr_t at = s->base;
    const Block* prev = nullptr;
    for (const Block* b = s->first; b != nullptr; prev = b, b = b->next) {
      if (b->seg != s) return fail("block points at another segment");
      if (b->prev != prev) return fail("prev link broken");
      if (b->addr != at) return fail("blocks do not tile the segment");
      if (b->addr % kMinBlock != 0) return fail("misaligned block");
      if (b->size == 0 || b->size % kMinBlock != 0) return fail("bad block size");
      at += b->size;
      if (b->state == State::kUnmapped) {
        if (!s->expandable) return fail("hole in a plain segment");
        if ((b->addr - s->base) % m.page != 0 || b->size % m.page != 0)
          return fail("hole not page-aligned");
        if (prev && prev->state == State::kUnmapped) return fail("two adjacent holes");
        if (b->next == nullptr) return fail("hole at the end of a segment");
        if (b->bin != -1 || m.live.find(b->addr) != nullptr) return fail("hole indexed");
        holes += b->size;
      } else if (b->state == State::kFree) {
        ++free_blocks;
        if (prev && prev->state == State::kFree) return fail("two adjacent free blocks");
        if (b->bin != bin_of(b->size)) return fail("free block in the wrong bin");
        bool found = false;
        for (const Block* f = s->index->heads[b->bin]; f; f = f->fnext) found |= (f == b);
        if (!found) return fail("free block missing from its bin list");
        if (m.live.find(b->addr) != nullptr) return fail("free block in the live map");
      } else {
        ++live_blocks;
        active += b->size;
        if (b->state == State::kAllocated && !b->cached.load(kRelaxed)) {
          allocated += b->requested;
          if (b->requested > b->size) return fail("block smaller than its request");
        }
        if (m.live.find(b->addr) != b) return fail("live block missing from the address map");
      }
    }
    if (prev != s->last) return fail("segment tail pointer wrong");
    if (at != s->base + s->size) return fail("blocks do not cover the segment");
    if (s->mapped + holes != s->size) return fail("mapped bytes differ from extent minus holes");
  }
  std::uint64_t binned = 0;
  for (const auto& ix : m.indexes) {
    for (int bin = 0; bin < kNumBins; ++bin) {
      const bool bit = (ix->bits[bin / 64] >> (bin % 64)) & 1;
      if (bit != (ix->heads[bin] != nullptr)) return fail("bin bitmap out of sync");
      for (const Block* f = ix->heads[bin]; f; f = f->fnext) {
        ++binned;
        if (f->state != State::kFree || f->seg->index != ix.get()) return fail("bin holds a non-free block");
      }
    }
  }
  if (binned != free_blocks) return fail("bins hold blocks that are not in any segment");
  if (m.live.size() != live_blocks) return fail("address map size differs from live blocks");
  std::uint64_t cached = 0;
  for (const PoolThreadCache* c : m.caches) {
    std::uint64_t in_cache = 0;
    for (std::size_t bin = 0; bin < c->bins.size(); ++bin) {
      const PoolThreadCache::Bin& cb = c->bins[bin];
      if (cb.n < 0 || cb.n > kCacheDepth) return fail("thread cache bin count out of range");
      for (int i = 0; i < cb.n; ++i) {
        const PoolThreadCache::Entry& e = cb.e[i];
        const Block* b = e.block;
        if (m.live.find(e.addr) != b || b->addr != e.addr || b->size != e.size ||
            bin_of(e.size) != static_cast<int>(bin) || b->cache_bin != static_cast<int>(bin) ||
            e.size > c->max_block) {
          return fail("thread cache entry does not match its block");
        }
        if (b->state != State::kAllocated || !b->cached.load(kRelaxed) || !b->uses.empty() ||
            b->owner.load(kRelaxed) != c || c->owned.find(b->addr) != b) {
          return fail("thread-cached block not allocated, owned and marked cached");
        }
        in_cache += e.size;
      }
    }
    if (in_cache != c->binned || in_cache > c->limit) {
      return fail("thread cache bin bytes wrong or over budget");
    }
    if (const Block* b = c->l0.block) {
      if (m.live.find(c->l0.addr) != b || b->addr != c->l0.addr || b->size != c->l0.size ||
          b->state != State::kAllocated || !b->cached.load(kRelaxed) ||
          b->owner.load(kRelaxed) != c || c->owned.find(b->addr) != b) {
        return fail("thread cache's last freed block not allocated, owned and marked cached");
      }
      in_cache += c->l0.size;
    }
    if (in_cache != c->cached.load(kRelaxed)) return fail("thread cache byte count wrong");
    cached += in_cache;
  }
  // What the fast path relies on: an owned block is allocated, used on its
  // stream only, and in its owner's map.
  for (const Segment* s : m.segments) {
    for (const Block* b = s->first; b != nullptr; b = b->next) {
      const auto* owner = static_cast<const PoolThreadCache*>(b->owner.load(kRelaxed));
      if (owner == nullptr) {
        if (b->cached.load(kRelaxed)) return fail("cached block without an owning cache");
        continue;
      }
      if (std::find(m.caches.begin(), m.caches.end(), owner) == m.caches.end())
        return fail("block owned by a cache the pool does not know");
      if (b->state != State::kAllocated || !b->uses.empty() || owner->owned.find(b->addr) != b)
        return fail("owned block not allocated, used on other streams, or missing from its map");
    }
  }
  const PoolStats st = m.merged();
  if (st.thread_cached_bytes != cached) return fail("thread-cached bytes differ from the caches");
  if (st.allocated_bytes != allocated || st.active_bytes != active ||
      st.reserved_bytes != reserved || st.num_live_blocks != live_blocks ||
      st.num_segments != m.segments.size()) {
    return fail("statistics differ from the recomputed sums");
  }
  if (st.peak_allocated_bytes < allocated || st.peak_reserved_bytes < reserved)
    return fail("a peak is below the current value");
  return true;
}

}  // namespace mapp
