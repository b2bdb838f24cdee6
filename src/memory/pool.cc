#include "mapp/memory/pool.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <sstream>

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

struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;
  Segment* seg = nullptr;
  Block* prev = nullptr;   // address neighbours in the segment
  Block* next = nullptr;
  Block* fprev = nullptr;  // links in a free bin
  Block* fnext = nullptr;
  State state = State::kFree;
  int bin = -1;
  std::vector<StreamId> uses;    // other streams (record_stream)
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
  PoolStats st;
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

  std::string oom_message(std::size_t bytes, StreamId stream) const {
    const DeviceInfo now = dev.query();
    std::ostringstream os;
    os << "out of memory: pool '" << opt.name << "' could not allocate " << human_bytes(bytes)
       << " on stream " << stream << ": " << grow_failure << " (" << dev.name() << " capacity "
       << human_bytes(now.total_bytes) << ", free " << human_bytes(now.free_bytes)
       << "; pool reserved " << human_bytes(st.reserved_bytes) << ", allocated "
       << human_bytes(st.allocated_bytes) << " after releasing its cache). Reduce the batch "
       << "or model size, or free tensors you no longer need";
    return os.str();
  }
};

CachingPool::CachingPool(DeviceBackend& device, PoolOptions options)
    : options_(std::move(options)), impl_(new Impl(device, options_)) {
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

CachingPool::~CachingPool() = default;

void* CachingPool::allocate(std::size_t bytes, StreamId stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Impl& m = *impl_;
  const std::size_t size = std::max(round_up(bytes, kMinBlock), kMinBlock);
  MAPP_CHECK(size >= bytes, "allocation of ", bytes, " bytes overflows");
  if (!m.pending.empty()) m.process_pending();
  const bool split_pools = !options_.expandable_segments || options_.expandable_small_pool;
  const Kind kind = split_pools && size <= options_.small_size ? Kind::kSmall : Kind::kLarge;
  FreeIndex& ix = m.index_for(kind, stream);
  Block* b = Impl::find_fit(ix, size);
  if (b != nullptr) {
    ++m.st.num_cache_hits;
  } else {
    if (options_.gc_threshold > 0.0 &&
        m.st.reserved_bytes + size > options_.gc_threshold * m.info.total_bytes) {
      m.release_cached();
    }
    b = m.grow(ix, size);
    if (b == nullptr) {
      ++m.st.num_oom_retries;
      m.release_cached();
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
  PoolStats& st = m.st;
  st.allocated_bytes += bytes;
  st.peak_allocated_bytes = std::max(st.peak_allocated_bytes, st.allocated_bytes);
  st.active_bytes += b->size;
  st.peak_active_bytes = std::max(st.peak_active_bytes, st.active_bytes);
  ++st.num_allocs;
  ++st.num_live_blocks;
  void* p = reinterpret_cast<void*>(b->addr);
  if (m.recorder) m.recorder->on_alloc(p, bytes, stream);
  return p;
}

void CachingPool::deallocate(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  Impl& m = *impl_;
  Block* b = m.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  MAPP_CHECK(b != nullptr && b->state == State::kAllocated, "pointer ", ptr,
             " was not allocated by pool '", options_.name, "' or was already freed");
  if (m.recorder) m.recorder->on_free(ptr);
  m.st.allocated_bytes -= b->requested;
  b->requested = 0;
  ++m.st.num_frees;
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
  MAPP_CHECK(b != nullptr && b->state == State::kAllocated, "record_stream: pointer ", ptr,
             " is not a live allocation of pool '", options_.name, "'");
  if (m.recorder) m.recorder->on_record_stream(ptr, stream);
  if (stream == b->seg->index->stream) return;
  if (std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
}

void CachingPool::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  if (impl_->recorder) impl_->recorder->on_release_cached();
  impl_->release_cached();
}

std::size_t CachingPool::block_size(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = impl_->live.find(reinterpret_cast<std::uintptr_t>(ptr));
  MAPP_CHECK(b != nullptr, "pointer ", ptr, " is not a live allocation of this pool");
  return b->size;
}

bool CachingPool::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return impl_->live.find(reinterpret_cast<std::uintptr_t>(ptr)) != nullptr;
}

PoolStats CachingPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return impl_->st;
}

void CachingPool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats& st = impl_->st;
  st.peak_allocated_bytes = st.allocated_bytes;
  st.peak_active_bytes = st.active_bytes;
  st.peak_reserved_bytes = st.reserved_bytes;
}

void CachingPool::set_recorder(AllocTraceRecorder* recorder) {
  std::lock_guard<std::mutex> lock(mu_);
  impl_->recorder = recorder;
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
        if (b->state == State::kAllocated) {
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
  const PoolStats& st = m.st;
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
