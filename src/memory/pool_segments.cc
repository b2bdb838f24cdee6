// The pool's device side: growing by segments or by mapping pages into an
// expandable segment, holes, giving memory back, teardown, the OOM message.
#include <sstream>

#include "pool_internal.h"

namespace mapp {

CachingPool::Impl::~Impl() {
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

void CachingPool::Impl::unmap_runs(Segment* s) {
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

void CachingPool::Impl::add_reserved(std::size_t bytes) {
  st.reserved_bytes += bytes;
  st.peak_reserved_bytes = std::max(st.peak_reserved_bytes, st.reserved_bytes);
  ++st.num_device_allocs;
}

Segment* CachingPool::Impl::new_segment(FreeIndex& ix, std::uintptr_t base, std::size_t size, bool expandable) {
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

Block* CachingPool::Impl::append_free_block(Segment* s, std::uintptr_t addr, std::size_t size) {
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

Block* CachingPool::Impl::grow(FreeIndex& ix, std::size_t size) {
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

Block* CachingPool::Impl::grow_expandable(FreeIndex& ix, std::size_t size) {
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

void CachingPool::Impl::release_cached() {
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

void CachingPool::Impl::drop_reserved(std::size_t bytes) {
  st.reserved_bytes -= bytes;
  ++st.num_device_frees;
}

Block* CachingPool::Impl::map_hole(Segment* s, std::size_t size) {
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

void CachingPool::Impl::unmap_free_pages(Segment* s) {
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

Block* CachingPool::Impl::carve_hole(Segment* s, Block* b, std::uintptr_t lo, std::uintptr_t hi) {
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

void CachingPool::Impl::release_all(PoolThreadCache* self) {
  if (self) flush(self);
  request(kFlush, self);
  release_cached();
}

std::string CachingPool::Impl::oom_message(std::size_t bytes, StreamId stream) const {
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

namespace pool_internal {

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

}  // namespace pool_internal
}  // namespace mapp
