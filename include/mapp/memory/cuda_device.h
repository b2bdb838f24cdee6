// CUDA backends of the device seam (built with the CUDA kernels).
//
// CudaDevice: device memory of one GPU. Plain segments come from cudaMalloc;
// virtual segments from the driver's virtual-memory API (cuMemAddressReserve,
// cuMemCreate, cuMemMap, cuMemSetAccess), whose entry points are looked up
// lazily through cudaGetDriverEntryPointByVersion — the library never links
// -lcuda, so it loads on machines that only have the driver stub. Events are
// cudaEvent_t (timing disabled) recorded on the stream.
// PinnedHostDevice: page-locked host memory (cudaHostAlloc) for staging and
// offload buffers; plain segments only.
#pragma once

#include <memory>

#include "mapp/memory/device.h"

namespace mapp {

class CudaDevice final : public DeviceBackend {
 public:
  explicit CudaDevice(int device);
  ~CudaDevice() override;
  const char* name() const override { return "cuda"; }
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
  int device() const { return device_; }

 private:
  struct Driver;
  int device_;
  std::unique_ptr<Driver> driver_;  // null when virtual memory is unavailable
};

class PinnedHostDevice final : public DeviceBackend {
 public:
  explicit PinnedHostDevice(std::size_t capacity_bytes);
  const char* name() const override { return "cuda-pinned-host"; }
  DeviceInfo query() const override;
  void* allocate(std::size_t bytes) override;
  void release(void* base, std::size_t bytes) override;

 private:
  std::size_t capacity_;
  std::size_t used_ = 0;
};

}  // namespace mapp
