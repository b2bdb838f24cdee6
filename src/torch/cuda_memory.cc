// CUDA allocator glue: entry points for torch.cuda.memory.CUDAPluggableAllocator.
//
// Trade-off (see docs/memory.md): a pluggable allocator replaces torch's
// caching allocator for the whole process and must be installed before the
// first CUDA allocation; torch.cuda.memory_stats() then raises (use
// megatronapp.memory.stats()), and record_stream is ours to honour. A
// torch.cuda.MemPool would keep torch's own block management and only take
// segments from us, which defeats the point of a better policy.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <vector>

#include "mapp/common/check.h"
#include "mapp/common/log.h"
#include "mapp/memory/cuda_device.h"
#include "mapp/torch/memory.h"

namespace mapp::torch_ext {
namespace {

struct CudaPools {
  std::mutex mu;
  PoolOptions options = [] {
    PoolOptions o;
    o.expandable_segments = true;
    o.name = "cuda";
    return o;
  }();
  std::vector<std::unique_ptr<CudaDevice>> devices;
  std::vector<std::unique_ptr<CachingPool>> pools;
};

CudaPools& pools() {
  static CudaPools* p = new CudaPools;  // leaked: frees may come during exit
  return *p;
}

CachingPool& pool_for(int device) {
  CudaPools& s = pools();
  std::lock_guard<std::mutex> lock(s.mu);
  MAPP_CHECK(device >= 0, "invalid CUDA device ", device);
  if (static_cast<std::size_t>(device) >= s.pools.size()) {
    s.devices.resize(device + 1);
    s.pools.resize(device + 1);
  }
  if (!s.pools[device]) {
    s.devices[device] = std::make_unique<CudaDevice>(device);
    PoolOptions o = s.options;
    if (o.expandable_segments && !s.devices[device]->query().supports_virtual) {
      log(LogLevel::kWarn, "CUDA virtual memory is unavailable; the pool uses plain segments");
      o.expandable_segments = false;
    }
    s.pools[device] = std::make_unique<CachingPool>(*s.devices[device], o);
  }
  return *s.pools[device];
}

}  // namespace

CachingPool* cuda_pool(int device) {
  CudaPools& s = pools();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<std::size_t>(device) < s.pools.size() ? s.pools[device].get() : nullptr;
}

void configure_cuda_pools(const PoolOptions& options) {
  CudaPools& s = pools();
  std::lock_guard<std::mutex> lock(s.mu);
  s.options = options;
}

}  // namespace mapp::torch_ext

// CUDAPluggableAllocator ABI (torch >= 2.2): sizes are ssize_t; free gets the
// device. A C++ exception must not cross into torch's C call: OOM returns
// nullptr, which torch reports as an out-of-memory error.
extern "C" {

__attribute__((visibility("default"))) void* mapp_cuda_malloc(ssize_t size, int device,
                                                              cudaStream_t stream) {
  try {
    return mapp::torch_ext::pool_for(device).allocate(static_cast<std::size_t>(size),
                                                      reinterpret_cast<mapp::StreamId>(stream));
  } catch (const std::exception& e) {
    mapp::log(mapp::LogLevel::kError, e.what());
    return nullptr;
  }
}

__attribute__((visibility("default"))) void mapp_cuda_free(void* ptr, ssize_t, int device,
                                                           cudaStream_t) {
  try {
    mapp::torch_ext::pool_for(device).deallocate(ptr);
  } catch (const std::exception& e) {
    mapp::log(mapp::LogLevel::kError, e.what());
  }
}

}  // extern "C"
