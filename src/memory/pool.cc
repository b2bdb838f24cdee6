#include "mapp/memory/pool.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <sstream>
#include <utility>

#include "pool_internal.h"

namespace mapp {

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

}  // namespace mapp
