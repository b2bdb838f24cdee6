#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include "mapp/common/check.h"
#include "mapp/memory/device.h"

namespace mapp {

// ---- defaults of the seam ---------------------------------------------------

void* DeviceBackend::reserve(std::size_t) {
  MAPP_CHECK(false, name(), " memory does not support virtual reservations; "
                            "disable expandable segments for this pool");
}
void DeviceBackend::unreserve(void*, std::size_t) { reserve(0); }
bool DeviceBackend::map(void*, std::size_t) { return reserve(0) != nullptr; }
void DeviceBackend::unmap(void*, std::size_t) { reserve(0); }
EventId DeviceBackend::record_event(StreamId) { return 0; }
bool DeviceBackend::event_done(EventId) { return true; }
void DeviceBackend::release_event(EventId) {}

// ---- HostDevice -------------------------------------------------------------

struct HostDevice::State {
  mutable std::mutex mu;
  EventId next_event = 1;
  EventId completed_up_to = 0;  // manual mode: events <= this are done
  std::unordered_set<EventId> live;
};

HostDevice::HostDevice() : HostDevice(Options{}) {}

HostDevice::HostDevice(Options options) : options_(options), state_(new State) {
  MAPP_CHECK(options_.granularity >= 4096 && (options_.granularity & (options_.granularity - 1)) == 0,
             "HostDevice granularity must be a power of two >= 4096, got ", options_.granularity);
}

HostDevice::~HostDevice() = default;

DeviceInfo HostDevice::query() const {
  DeviceInfo info;
  info.total_bytes = options_.capacity_bytes;
  info.free_bytes = options_.capacity_bytes - used_;
  info.granularity = options_.granularity;
  info.supports_virtual = options_.supports_virtual;
  return info;
}

void* HostDevice::allocate(std::size_t bytes) {
  MAPP_CHECK(bytes > 0, "HostDevice::allocate of 0 bytes");
  if (bytes > options_.capacity_bytes - used_) return nullptr;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  used_ += bytes;
  return p;
}

void HostDevice::release(void* base, std::size_t bytes) {
  if (::munmap(base, bytes) != 0) {
    MAPP_FAIL_BACKEND("munmap(", base, ", ", bytes, ") failed: ", std::strerror(errno));
  }
  used_ -= bytes;
}

void* HostDevice::reserve(std::size_t bytes) {
  MAPP_CHECK(options_.supports_virtual, "this HostDevice was created without virtual memory");
  MAPP_CHECK(bytes > 0 && bytes % options_.granularity == 0,
             "reserve size ", bytes, " is not a positive multiple of the granularity ",
             options_.granularity);
  void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void HostDevice::unreserve(void* base, std::size_t bytes) {
  if (::munmap(base, bytes) != 0) {
    MAPP_FAIL_BACKEND("munmap of a reservation failed: ", std::strerror(errno));
  }
}

bool HostDevice::map(void* addr, std::size_t bytes) {
  MAPP_CHECK(bytes % options_.granularity == 0 &&
                 reinterpret_cast<std::uintptr_t>(addr) % options_.granularity == 0,
             "map(", addr, ", ", bytes, ") is not aligned to the granularity ",
             options_.granularity);
  if (bytes > options_.capacity_bytes - used_) return false;
  if (::mprotect(addr, bytes, PROT_READ | PROT_WRITE) != 0) return false;
  used_ += bytes;
  return true;
}

void HostDevice::unmap(void* addr, std::size_t bytes) {
  // Give the pages back and make the range inaccessible again.
  if (::madvise(addr, bytes, MADV_DONTNEED) != 0 || ::mprotect(addr, bytes, PROT_NONE) != 0) {
    MAPP_FAIL_BACKEND("unmap(", addr, ", ", bytes, ") failed: ", std::strerror(errno));
  }
  used_ -= bytes;
}

EventId HostDevice::record_event(StreamId) {
  std::lock_guard<std::mutex> lock(state_->mu);
  const EventId id = state_->next_event++;
  state_->live.insert(id);
  if (!options_.manual_events) state_->completed_up_to = id;
  return id;
}

bool HostDevice::event_done(EventId event) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return event <= state_->completed_up_to;
}

void HostDevice::release_event(EventId event) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->live.erase(event);
}

void HostDevice::complete_events() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->completed_up_to = state_->next_event - 1;
}

std::size_t HostDevice::live_events() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->live.size();
}

}  // namespace mapp
