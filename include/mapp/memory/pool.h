// CachingPool: a caching allocator over a DeviceBackend.
//
// Note [Pool policy]
//  1. Sizes round up to kMinBlock (512 B); blocks split exactly, so internal
//     waste is below 512 B per allocation.
//  2. Two pools with plain segments: small requests (<= small_size, 1 MiB) and
//     large ones never share a segment, so long-lived large tensors do not pin
//     small slivers. With expandable segments both share the one segment of
//     their stream (unless expandable_small_pool): any free neighbours merge
//     there anyway, and one growing tail instead of two wastes less — measured
//     on the 12 recorded GPT traces, peak fragmentation 0.1-6.1% shared against
//     2.4-11.7% split (benchmarks/RESULTS.md).
//  3. Free blocks are indexed per (pool, stream) in segregated bins — 8 bins
//     per power of two (TLSF-style) with a bitmap of non-empty bins. Lookup is
//     best-fit within the request's own bin (bounded scan), else the first
//     block of the next non-empty bin: O(1) with no allocation on the hot path.
//  4. A found block larger than the request is split when the remainder is at
//     least split_remainder(pool); freed blocks merge with free neighbours of
//     the same segment immediately.
//  5. Blocks belong to the stream they were allocated on. A block used on other
//     streams (record_stream) returns to the free lists only after events
//     recorded on those streams at free time have completed.
//  6. When nothing fits the pool grows: a new segment (plain mode) or more
//     mapped pages at the end of the (pool, stream) expandable segment, which
//     then merge with a free tail — see Note [Expandable segments].
//  7. Out of memory: release every cached segment / unmapped tail, retry once,
//     then throw OutOfMemoryError with the pool's numbers; the pool stays valid.
//  8. Optional garbage-collection threshold: before growing past
//     gc_threshold * capacity, release cached memory first.
//
// Note [Expandable segments]
//  Rationale: with plain segments, blocks in different segments never merge,
//  so a workload whose sizes drift (batch size N -> N+1, per-layer buffers)
//  strands free slivers at segment ends. Approach: per (pool, stream) reserve
//  one large address range and map granularity-sized pages at its end on
//  demand; everything mapped is one segment, so any two free neighbours merge.
//  Limitations: free pages are given back only by release_cached() (and the
//  out-of-memory retry): interior ones become holes that later growth remaps
//  first, a free tail shrinks the extent; memory from virtual mappings cannot be
//  shared through CUDA IPC; the address range reserved is va_bytes per
//  (pool, stream) — twice the capacity by default, since a long-lived block
//  near the end keeps the extent from shrinking and growth must go past it.
//
// Note [Thread cache]
//  Rationale: an uncontended mutex costs an atomic read-modify-write to take and
//  another to give back; the same-size free+allocate pairs of a training step
//  (torch's CPU tensors) should cost a few plain loads and stores, like glibc's
//  tcache. Approach (thread_cache_bytes > 0): each thread keeps, per pool,
//   * the block it freed last ("l0"), up to 16 x thread_cache_bytes;
//   * bins of blocks it freed before: the pool's bins, exact sizes, 4 deep,
//     blocks up to thread_cache_bytes / 2, thread_cache_bytes in all;
//   * a map of the stream-0 blocks it owns (allocated by it, or cached), so a
//     free finds its block without the pool's address map.
//  To the pool a cached block is an allocated block owned by that thread's
//  cache: neighbours never merge into it and the invariants below hold.
//  allocate() on stream 0 takes l0 if it has the size, else an exact-size block
//  of the bins; deallocate() of a block this thread owns makes it l0 and moves
//  the previous l0 to its bin. Neither takes the mutex nor an atomic RMW (a
//  pair is ~6 ns; benchmarks/RESULTS.md). The locked path handles the rest: a
//  miss, other streams, blocks used on other streams (record_stream ends the
//  ownership), blocks another thread allocated (their owner's map entry goes
//  stale and is recognised by the block's owner field), and a previous l0 that
//  fits no bin (too large, bin full, budget spent), which goes back to the pool.
//  Fragmentation: cached blocks never make the pool grow. When nothing fits,
//  the calling thread's cache goes back to the pool (the other threads' at
//  their next operation) before the pool maps more memory.
//  Statistics: counters are kept per thread and summed by stats(), exact once
//  every thread's operations happened before the call. A thread's fast
//  allocation compares its own count plus the rest of the pool as of its last
//  locked operation with its peak, so peak_allocated_bytes is exact when one
//  thread allocates; with several it may miss by what the others did without
//  the lock since (at most what their caches hold).
//  Limitations: release_cached() and the out-of-memory retry give back the
//  calling thread's cache at once; other threads give theirs back at their next
//  operation on the pool, and when they exit. Recording a trace turns the fast
//  path off (in other threads from their next operation). Stream 0 only:
//  device pools leave it off (thread_cache_bytes 0).
//
// Invariants (checked by is_valid()):
//  * Every segment's blocks tile [base, base + size) in address order,
//    prev/next links agree, block addresses are kMinBlock-aligned.
//  * No two address-adjacent free blocks (coalescing is eager).
//  * A free block is in exactly one bin: the bin of its size in its
//    (pool, stream) index; bitmap bits equal "bin non-empty".
//  * The address map holds exactly the allocated and event-pending blocks.
//  * Statistics equal the sums recomputed from the blocks.
//  * A thread cache's entries are allocated, cached blocks it owns, summing to
//    its cached bytes. (Thread caches are read without their threads' help:
//    call is_valid() when no other thread uses the pool.)
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mapp/common/check.h"
#include "mapp/memory/device.h"

namespace mapp {

class AllocTraceRecorder;
struct PoolThreadCache;  // src/memory/pool_internal.h (Note [Thread cache])

// Allocation failed after releasing cached memory. Derives from
// std::runtime_error (Python: RuntimeError / torch.OutOfMemoryError at the edge).
class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PoolOptions {
  bool expandable_segments = false;
  std::size_t small_size = std::size_t(1) << 20;         // <= this: small pool
  std::size_t small_segment = std::size_t(2) << 20;      // plain small segment
  std::size_t large_segment = std::size_t(20) << 20;     // plain segment for 1..10 MiB
  std::size_t min_large_alloc = std::size_t(10) << 20;   // >= this: own segment
  std::size_t round_large = std::size_t(2) << 20;        // rounding of own segments
  std::size_t small_split_remainder = 512;               // split if remainder >= this
  std::size_t large_split_remainder = 512;               // (torch: > 1 MiB)
  std::size_t va_bytes = 0;            // expandable reservation per (pool, stream); 0 = 2 x capacity
  bool expandable_small_pool = false;  // expandable: keep a separate small pool (Note 2)
  double gc_threshold = 0.0;           // (0, 1]: release cache before exceeding; 0 = off
  // Per-thread cache of freed stream-0 blocks (Note [Thread cache]): bytes in
  // its bins per thread (blocks up to half of it), plus the block freed last if
  // at most 16 times this. 0 = off.
  std::size_t thread_cache_bytes = 0;
  // What megatronapp.memory.use_pool("cpu") gives each thread by default.
  static constexpr std::size_t kDefaultThreadCacheBytes = std::size_t(1) << 20;
  std::string name = "pool";

  // PyTorch CUDACachingAllocator's default policy, reproduced on our
  // machinery, for side-by-side comparisons on the same traces.
  static PoolOptions torch_like();
};

struct PoolStats {
  std::uint64_t allocated_bytes = 0;       // requested bytes of live allocations
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t active_bytes = 0;          // block bytes of live (and pending) blocks
  std::uint64_t peak_active_bytes = 0;
  std::uint64_t reserved_bytes = 0;        // bytes obtained from the device
  std::uint64_t peak_reserved_bytes = 0;
  std::uint64_t num_allocs = 0;
  std::uint64_t num_frees = 0;
  std::uint64_t num_cache_hits = 0;        // served without growing
  std::uint64_t num_device_allocs = 0;     // segments allocated or page ranges mapped
  std::uint64_t num_device_frees = 0;
  std::uint64_t num_oom_retries = 0;       // grew only after releasing the cache
  std::uint64_t num_ooms = 0;
  std::uint64_t num_segments = 0;
  std::uint64_t num_live_blocks = 0;
  std::uint64_t thread_cached_bytes = 0;   // freed blocks held by thread caches
                                           // (part of active and reserved)
  // 1 - peak allocated / peak reserved (GMLake's definition, at peaks).
  double fragmentation() const {
    return peak_reserved_bytes == 0
               ? 0.0
               : 1.0 - static_cast<double>(peak_allocated_bytes) / peak_reserved_bytes;
  }
};

class CachingPool {
 public:
  static constexpr std::size_t kMinBlock = 512;

  // The backend must outlive the pool.
  CachingPool(DeviceBackend& device, PoolOptions options = {});
  ~CachingPool();  // releases every segment; live allocations become invalid
  CachingPool(const CachingPool&) = delete;
  CachingPool& operator=(const CachingPool&) = delete;

  // At least `bytes` (0 gives a valid unique pointer of kMinBlock) usable on
  // `stream`, aligned to kMinBlock. Throws OutOfMemoryError.
  void* allocate(std::size_t bytes, StreamId stream = 0);
  // Throws ValueError for pointers this pool did not return (or freed twice).
  void deallocate(void* ptr);
  // `ptr` is also used on `stream`: its memory is reused only after work
  // queued there before deallocate() completes.
  void record_stream(void* ptr, StreamId stream);
  // Gives every cached segment (plain) and unmapped-able free tail
  // (expandable) back to the device.
  void release_cached();

  // Size of the block behind a live pointer.
  std::size_t block_size(const void* ptr) const;
  bool owns(const void* ptr) const;

  PoolStats stats() const;
  void reset_peak_stats();
  std::string summary() const;      // human-readable, several lines
  std::string stats_json() const;   // one JSON object
  const PoolOptions& options() const { return options_; }

  // Checks every invariant in the header; on failure returns false and, if
  // `why` is given, says which.
  bool is_valid(std::string* why = nullptr) const;

  // Appends every operation to `recorder` (nullptr stops recording).
  void set_recorder(AllocTraceRecorder* recorder);

 private:
  friend struct PoolThreadCache;
  struct Impl;
  PoolThreadCache* thread_cache(bool create);  // this thread's, or nullptr
  [[gnu::noinline]] void* allocate_slow(std::size_t bytes, StreamId stream);
  [[gnu::noinline]] void deallocate_slow(void* ptr);
  void* allocate_locked(std::size_t bytes, StreamId stream, PoolThreadCache* cache);
  void deallocate_locked(void* ptr, PoolThreadCache* cache);
  void retire(PoolThreadCache* cache);  // the cache's thread exits

  PoolOptions options_;
  std::unique_ptr<Impl> impl_;
  const std::uint64_t id_;  // never reused: names this pool in thread caches
  mutable std::mutex mu_;   // guards impl_; held only for O(1) bookkeeping
};

}  // namespace mapp
