#include "mapp/memory/cuda_device.h"

#include <cuda.h>  // driver API types only; functions come from entry points
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <map>
#include <mutex>
#include <vector>

#include "mapp/common/check.h"

// Every CUDA runtime call is checked; failures name the call and the error.
#define MAPP_CUDA_CHECK(expr)                                                       \
  do {                                                                              \
    const cudaError_t mapp_err_ = (expr);                                           \
    if (mapp_err_ != cudaSuccess) {                                                 \
      MAPP_FAIL_BACKEND(#expr, " failed: ", cudaGetErrorName(mapp_err_), " (",      \
                        cudaGetErrorString(mapp_err_), ")");                        \
    }                                                                               \
  } while (0)

namespace mapp {
namespace {

class DeviceGuard {  // restores the current device on scope exit
 public:
  explicit DeviceGuard(int device) {
    MAPP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MAPP_CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int device_ = 0;
};

template <typename F>
F entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) return nullptr;
  return reinterpret_cast<F>(fn);
}

}  // namespace

struct CudaDevice::Driver {
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
  std::size_t page = 0;
  // Physical handles by mapped address: unmap needs them to release memory.
  std::map<std::uintptr_t, std::pair<CUmemGenericAllocationHandle, std::size_t>> handles;

  bool load() {
    create = entry_point<PFN_cuMemCreate_v10020>("cuMemCreate");
    release = entry_point<PFN_cuMemRelease_v10020>("cuMemRelease");
    reserve = entry_point<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve");
    address_free = entry_point<PFN_cuMemAddressFree_v10020>("cuMemAddressFree");
    map = entry_point<PFN_cuMemMap_v10020>("cuMemMap");
    unmap = entry_point<PFN_cuMemUnmap_v10020>("cuMemUnmap");
    set_access = entry_point<PFN_cuMemSetAccess_v10020>("cuMemSetAccess");
    granularity = entry_point<PFN_cuMemGetAllocationGranularity_v10020>(
        "cuMemGetAllocationGranularity");
    error_string = entry_point<PFN_cuGetErrorString_v6000>("cuGetErrorString");
    device_get = entry_point<PFN_cuDeviceGet_v2000>("cuDeviceGet");
    device_attribute = entry_point<PFN_cuDeviceGetAttribute_v2000>("cuDeviceGetAttribute");
    return device_get && device_attribute && create && release && reserve && address_free && map && unmap && set_access &&
           granularity;
  }

  void check(CUresult r, const char* what) const {
    if (r == CUDA_SUCCESS) return;
    const char* msg = "unknown error";
    if (error_string) error_string(r, &msg);
    MAPP_FAIL_BACKEND(what, " failed: ", msg, " (CUresult ", int(r), ")");
  }

  CUmemAllocationProp prop(int device) const {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
  }
};

CudaDevice::CudaDevice(int device) : device_(device) {
  DeviceGuard guard(device_);
  auto d = std::make_unique<Driver>();
  if (d->load()) {
    CUdevice dev{};
    int supported = 0;
    d->check(d->device_get(&dev, device_), "cuDeviceGet");
    d->check(d->device_attribute(&supported,
                                 CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
             "cuDeviceGetAttribute");
    if (supported) {
      CUmemAllocationProp p = d->prop(device_);
      d->check(d->granularity(&d->page, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity");
      // Map in 2 MiB pages (the minimum on current GPUs) or the minimum if larger.
      d->page = std::max<std::size_t>(d->page, std::size_t(2) << 20);
      driver_ = std::move(d);
    }
  }
}

CudaDevice::~CudaDevice() = default;

DeviceInfo CudaDevice::query() const {
  DeviceGuard guard(device_);
  std::size_t free_b = 0, total_b = 0;
  MAPP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  DeviceInfo info;
  info.total_bytes = total_b;
  info.free_bytes = free_b;
  info.granularity = driver_ ? driver_->page : (std::size_t(2) << 20);
  info.supports_virtual = driver_ != nullptr;
  return info;
}

void* CudaDevice::allocate(std::size_t bytes) {
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear the sticky-free OOM error
    return nullptr;
  }
  MAPP_CUDA_CHECK(err);
  return p;
}

void CudaDevice::release(void* base, std::size_t) {
  DeviceGuard guard(device_);
  MAPP_CUDA_CHECK(cudaFree(base));
}

void* CudaDevice::reserve(std::size_t bytes) {
  MAPP_CHECK(driver_ != nullptr, "CUDA virtual memory management is not available on device ",
             device_, "; disable expandable segments");
  CUdeviceptr p = 0;
  const CUresult r = driver_->reserve(&p, bytes, driver_->page, 0, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  driver_->check(r, "cuMemAddressReserve");
  return reinterpret_cast<void*>(p);
}

void CudaDevice::unreserve(void* base, std::size_t bytes) {
  driver_->check(driver_->address_free(reinterpret_cast<CUdeviceptr>(base), bytes),
                 "cuMemAddressFree");
}

bool CudaDevice::map(void* addr, std::size_t bytes) {
  DeviceGuard guard(device_);
  Driver& d = *driver_;
  CUmemAllocationProp p = d.prop(device_);
  CUmemGenericAllocationHandle h{};
  const CUresult r = d.create(&h, bytes, &p, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
  d.check(r, "cuMemCreate");
  const auto va = reinterpret_cast<CUdeviceptr>(addr);
  d.check(d.map(va, bytes, 0, h, 0), "cuMemMap");
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  d.check(d.set_access(va, bytes, &access, 1), "cuMemSetAccess");
  d.handles[va] = {h, bytes};
  return true;
}

void CudaDevice::unmap(void* addr, std::size_t bytes) {
  // The pool unmaps ranges that may cover several earlier maps, or part of one
  // (whole pages). Physical handles are per map() call, so a partial unmap of
  // a handle re-maps nothing: we split the bookkeeping by unmapping each whole
  // handle inside the range; a range cutting a handle is split by remapping
  // the kept part with a fresh handle.
  DeviceGuard guard(device_);
  Driver& d = *driver_;
  const auto lo = reinterpret_cast<CUdeviceptr>(addr);
  const CUdeviceptr hi = lo + bytes;
  std::vector<std::pair<CUdeviceptr, std::size_t>> keep;  // parts to re-back
  auto it = d.handles.upper_bound(lo);
  if (it != d.handles.begin()) --it;
  while (it != d.handles.end() && it->first < hi) {
    const CUdeviceptr a = it->first;
    const std::size_t n = it->second.second;
    if (a + n <= lo) {
      ++it;
      continue;
    }
    d.check(d.unmap(a, n), "cuMemUnmap");
    d.check(d.release(it->second.first), "cuMemRelease");
    if (a < lo) keep.emplace_back(a, lo - a);
    if (a + n > hi) keep.emplace_back(hi, a + n - hi);
    it = d.handles.erase(it);
  }
  for (auto& [a, n] : keep) {
    MAPP_CHECK(map(reinterpret_cast<void*>(a), n), "re-mapping ", n,
               " bytes kept from a split physical allocation ran out of memory");
  }
}

EventId CudaDevice::record_event(StreamId stream) {
  DeviceGuard guard(device_);
  cudaEvent_t e = nullptr;
  MAPP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  MAPP_CUDA_CHECK(cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream)));
  return reinterpret_cast<EventId>(e);
}

bool CudaDevice::event_done(EventId event) {
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  MAPP_CUDA_CHECK(err);
  return true;
}

void CudaDevice::release_event(EventId event) {
  MAPP_CUDA_CHECK(cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)));
}

PinnedHostDevice::PinnedHostDevice(std::size_t capacity_bytes) : capacity_(capacity_bytes) {}

DeviceInfo PinnedHostDevice::query() const {
  DeviceInfo info;
  info.total_bytes = capacity_;
  info.free_bytes = capacity_ - used_;
  info.granularity = std::size_t(2) << 20;
  return info;
}

void* PinnedHostDevice::allocate(std::size_t bytes) {
  if (bytes > capacity_ - used_) return nullptr;
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  MAPP_CUDA_CHECK(err);
  used_ += bytes;
  return p;
}

void PinnedHostDevice::release(void* base, std::size_t bytes) {
  MAPP_CUDA_CHECK(cudaFreeHost(base));
  used_ -= bytes;
}

}  // namespace mapp
