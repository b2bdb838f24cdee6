// Introspection of the pool: the invariant checker used by the tests and the
// fuzzers, the human summary and the JSON statistics.
#include <cinttypes>
#include <cstdio>
#include <sstream>

#include "pool_internal.h"

namespace mapp {

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
     << ",\"gc_threshold\":" << options_.gc_threshold
     << ",\"thread_cache_bytes\":" << options_.thread_cache_bytes
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
