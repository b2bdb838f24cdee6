// Allocation traces: record what a pool was asked to do, save it compactly,
// and replay it through any pool policy to compare peak reserved memory,
// utilization and time per operation on exactly the same requests.
//
// File format (little-endian; version 1):
//   8 bytes  magic "MAPPTRC1"
//   8 bytes  u64 number of events
//   events, each: 1 byte op, then LEB128 varints:
//     op 1 alloc          id, size, stream
//     op 2 free           id
//     op 3 record_stream  id, stream
//     op 4 release_cached (nothing)
// Ids number allocations in order of appearance; a freed id may not be reused.
// load() rejects anything else (bad magic, unknown op, truncated varint, free
// of an unknown id, trailing bytes) with a ValueError naming the byte offset.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "mapp/memory/device.h"
#include "mapp/memory/pool.h"

namespace mapp {

enum class TraceOp : std::uint8_t { kAlloc = 1, kFree = 2, kRecordStream = 3, kReleaseCached = 4 };

struct TraceEvent {
  TraceOp op;
  std::uint64_t id = 0;
  std::uint64_t size = 0;
  StreamId stream = 0;
};

struct AllocTrace {
  std::vector<TraceEvent> events;

  void save(const std::string& path) const;
  static AllocTrace load(const std::string& path);
  std::string encode() const;                        // the file's bytes
  static AllocTrace decode(const std::string& bytes);  // throws ValueError
};

// Receives a pool's operations (CachingPool::set_recorder) and numbers them.
class AllocTraceRecorder {
 public:
  void on_alloc(const void* ptr, std::size_t bytes, StreamId stream);
  void on_free(const void* ptr);
  void on_record_stream(const void* ptr, StreamId stream);
  void on_release_cached();
  const AllocTrace& trace() const { return trace_; }

 private:
  AllocTrace trace_;
  std::unordered_map<const void*, std::uint64_t> ids_;
  std::uint64_t next_id_ = 0;
};

struct ReplayResult {
  PoolStats stats;
  std::uint64_t operations = 0;
  double seconds = 0.0;         // time inside the pool's calls
  double ns_per_op() const { return operations ? 1e9 * seconds / operations : 0.0; }
  double utilization() const { return 1.0 - stats.fragmentation(); }
};

// Replays `trace` through a fresh pool with `options` on `device`. Memory is
// real, nothing is written to it. Throws ValueError on an inconsistent trace
// and OutOfMemoryError if the device is too small for it.
ReplayResult replay(const AllocTrace& trace, DeviceBackend& device, const PoolOptions& options);

}  // namespace mapp
