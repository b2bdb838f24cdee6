// The device seam of the memory pool: the few primitives the pool needs from
// whatever provides memory (CUDA device memory, pinned host memory, plain host
// memory for CPU training and tests). Everything else — size classes, splitting,
// coalescing, stream safety, statistics — lives in the pool, once.
//
// Two ways to provide memory:
//  * plain:   allocate(bytes) -> a new segment, release(base, bytes) gives it back.
//  * virtual: reserve(bytes) -> address range with nothing behind it; map /
//             unmap granularity-aligned sub-ranges on demand. Only when
//             query().supports_virtual. This is what lets "expandable segments"
//             grow in place, so freed neighbours always merge.
// Stream ordering: record_event(stream) marks "everything queued on `stream` so
// far"; event_done tells whether that work has finished.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mapp {

using StreamId = std::uintptr_t;  // cudaStream_t value on GPUs; 0 = default stream
using EventId = std::uint64_t;

struct DeviceInfo {
  std::size_t total_bytes = 0;   // capacity the pool may use
  std::size_t free_bytes = 0;    // not yet handed out by the backend
  std::size_t granularity = 0;   // map/unmap unit (virtual mode), bytes
  bool supports_virtual = false;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual const char* name() const = 0;
  virtual DeviceInfo query() const = 0;

  // Plain segments. Precondition: bytes > 0. Returns a base aligned to at least
  // 512 bytes, or nullptr when the device is out of memory (never throws for
  // OOM; throws BackendError for other failures).
  virtual void* allocate(std::size_t bytes) = 0;
  // Precondition: (base, bytes) was returned by allocate and not yet released.
  virtual void release(void* base, std::size_t bytes) = 0;

  // Virtual segments (only if query().supports_virtual). reserve returns an
  // address range of `bytes` (a multiple of granularity) or nullptr.
  virtual void* reserve(std::size_t bytes);
  virtual void unreserve(void* base, std::size_t bytes);
  // Backs [addr, addr + bytes) (granularity-aligned, inside a reservation, not
  // mapped) with memory; false when out of memory.
  virtual bool map(void* addr, std::size_t bytes);
  // Precondition: the range is mapped. Gives its memory back.
  virtual void unmap(void* addr, std::size_t bytes);

  // Stream ordering. Backends without asynchronous streams complete events
  // immediately (the defaults).
  virtual EventId record_event(StreamId stream);
  virtual bool event_done(EventId event);
  virtual void release_event(EventId event);
};

// Host memory from the operating system (mmap). Real memory, so tests can write
// through every pointer; `capacity_bytes` caps what it hands out so that
// out-of-memory paths are testable. Virtual mode reserves PROT_NONE address
// space and maps with mprotect. Events are manual when `manual_events` is set:
// they stay pending until complete_events() — a fake of asynchronous streams.
class HostDevice final : public DeviceBackend {
 public:
  struct Options {
    std::size_t capacity_bytes = std::size_t(1) << 40;
    std::size_t granularity = std::size_t(2) << 20;  // 2 MiB
    bool supports_virtual = true;
    bool manual_events = false;
  };
  HostDevice();
  explicit HostDevice(Options options);
  ~HostDevice() override;

  const char* name() const override { return "host"; }
  DeviceInfo query() const override;
  void* allocate(std::size_t bytes) override;
  void release(void* base, std::size_t bytes) override;
  void* reserve(std::size_t bytes) override;
  void unreserve(void* base, std::size_t bytes) override;
  bool map(void* addr, std::size_t bytes) override;
  void unmap(void* addr, std::size_t bytes) override;
  EventId record_event(StreamId stream) override;
  bool event_done(EventId event) override;
  void release_event(EventId event) override;

  // Manual events: everything recorded so far completes.
  void complete_events();
  std::size_t used_bytes() const { return used_; }
  std::size_t live_events() const;

 private:
  struct State;
  Options options_;
  std::size_t used_ = 0;
  std::unique_ptr<State> state_;
};

}  // namespace mapp
