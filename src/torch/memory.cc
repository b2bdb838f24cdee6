// CPU allocator glue: the pool behind torch's CPU tensors.
#include "mapp/torch/memory.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>
#ifdef MAPP_WITH_CUDA_KERNELS
#include <cuda_runtime.h>

#include "mapp/memory/cuda_device.h"
#endif

#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "mapp/common/check.h"
#include "mapp/memory/trace.h"

namespace mapp::torch_ext {
namespace {

// Leaked on purpose: tensors served by the pool may be freed during static
// destruction, after any destructor of ours would have run.
struct CpuPoolState {
  HostDevice device{[] {
    HostDevice::Options o;
    // Physical memory: also the address range each expandable segment reserves.
    o.capacity_bytes = static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) *
                       static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    return o;
  }()};
  std::unique_ptr<CachingPool> pool;
  c10::Allocator* previous = nullptr;
  std::unique_ptr<AllocTraceRecorder> recorder;
  int swaps = 0;  // allocator swaps so far: the priority of the next one
  std::mutex mu;
};

CpuPoolState& state() {
  static CpuPoolState* s = new CpuPoolState;
  return *s;
}

std::atomic<CachingPool*> g_pool{nullptr};

void delete_from_pool(void* ptr) {
  if (ptr != nullptr) g_pool.load(std::memory_order_acquire)->deallocate(ptr);
}

class PoolCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) override {
    if (n == 0) return {nullptr, nullptr, &delete_from_pool, c10::Device(c10::DeviceType::CPU)};
    void* p = g_pool.load(std::memory_order_acquire)->allocate(n);
    return {p, p, &delete_from_pool, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_from_pool; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PoolCpuAllocator g_allocator;

// Priorities: torch registers its CPU allocator at 0 and SetAllocator only
// replaces at a priority >= the current one, so every swap (install, restore,
// install again) takes the next priority: 1, 2, 3, ...
std::uint8_t next_priority(CpuPoolState& s) {
  MAPP_CHECK_STATE(s.swaps < 255,
                   "the CPU allocator was swapped 255 times in this process (torch's "
                   "priorities end there); keep the pool installed instead of "
                   "restoring and installing it again");
  return static_cast<std::uint8_t>(++s.swaps);
}

}  // namespace

CachingPool& install_cpu_pool(const PoolOptions& options) {
  CpuPoolState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.pool) {
    const PoolOptions& have = s.pool->options();
    MAPP_CHECK(have.expandable_segments == options.expandable_segments &&
                   have.gc_threshold == options.gc_threshold &&
                   have.thread_cache_bytes == options.thread_cache_bytes,
               "the CPU memory pool is already installed with different options "
               "(expandable_segments=", have.expandable_segments, ", gc_threshold=",
               have.gc_threshold, ", thread_cache_bytes=", have.thread_cache_bytes,
               "); it can be installed once per process");
  } else {
    s.pool = std::make_unique<CachingPool>(s.device, options);
    g_pool.store(s.pool.get(), std::memory_order_release);
  }
  c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
  if (current != &g_allocator) {
    s.previous = current;
    c10::SetAllocator(c10::DeviceType::CPU, &g_allocator, next_priority(s));
    MAPP_CHECK_STATE(c10::GetAllocator(c10::DeviceType::CPU) == &g_allocator,
                     "torch refused the CPU allocator swap (another allocator was "
                     "installed with a higher priority)");
  }
  return *s.pool;
}

CachingPool* cpu_pool() { return g_pool.load(std::memory_order_acquire); }

void restore_cpu_allocator() {
  CpuPoolState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.previous != nullptr && c10::GetAllocator(c10::DeviceType::CPU) == &g_allocator) {
    c10::SetAllocator(c10::DeviceType::CPU, s.previous, next_priority(s));
  }
}

void start_cpu_trace() {
  CpuPoolState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  MAPP_CHECK_STATE(s.pool != nullptr, "start the CPU memory pool (use_pool) before recording");
  s.recorder = std::make_unique<AllocTraceRecorder>();
  s.pool->set_recorder(s.recorder.get());
}

std::size_t stop_cpu_trace(const std::string& path) {
  CpuPoolState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  MAPP_CHECK_STATE(s.recorder != nullptr, "no allocation trace is being recorded");
  s.pool->set_recorder(nullptr);
  s.recorder->trace().save(path);
  const std::size_t n = s.recorder->trace().events.size();
  s.recorder.reset();
  return n;
}

namespace {

// Host staging buffers (pipeline / data-parallel communication, offload):
// page-locked when a CUDA device is present, so copies to and from the GPU are
// asynchronous DMA; plain host memory otherwise. Leaked like the CPU pool.
struct StagingPool {
  std::unique_ptr<DeviceBackend> device;
  std::unique_ptr<CachingPool> pool;
  StagingPool() {
    const std::size_t phys = static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) *
                             static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    PoolOptions o;
#ifdef MAPP_WITH_CUDA_KERNELS
    int n = 0;
    if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
      device = std::make_unique<PinnedHostDevice>(phys / 2);
      o.name = "staging-pinned";
    }
    (void)cudaGetLastError();  // no device: clear the error state
#endif
    if (!device) {
      HostDevice::Options h;
      h.capacity_bytes = phys;
      device = std::make_unique<HostDevice>(h);
      o.expandable_segments = true;
      o.name = "staging-host";
    }
    pool = std::make_unique<CachingPool>(*device, o);
  }
};

StagingPool& staging() {
  static StagingPool* s = new StagingPool;
  return *s;
}

}  // namespace

CachingPool& staging_pool() { return *staging().pool; }

at::Tensor empty_staging(at::IntArrayRef size, at::ScalarType dtype) {
  std::int64_t numel = 1;
  for (std::int64_t d : size) {
    MAPP_CHECK(d >= 0, "empty_staging: negative dimension ", d, " in ", size);
    numel *= d;
  }
  const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  CachingPool& pool = staging_pool();
  void* p = pool.allocate(bytes);
  return at::from_blob(p, size, [&pool](void* q) { pool.deallocate(q); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace mapp::torch_ext

TORCH_LIBRARY_FRAGMENT(mapp, m) {
  m.def("empty_staging(int[] size, ScalarType dtype) -> Tensor", &mapp::torch_ext::empty_staging);
}
