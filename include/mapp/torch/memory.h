// The memory pool as PyTorch's allocator.
//
// CPU: install_cpu_pool() swaps torch's CPU allocator (c10::SetAllocator) for a
// CachingPool over host memory, so CPU training runs on the pool. Tensors made
// before the swap keep their own deleters; the pool is never destroyed, so
// tensors it served stay valid even after restore_cpu_allocator().
// CUDA: the extern "C" pair mapp_cuda_malloc / mapp_cuda_free in this library
// are the entry points of torch.cuda.memory.CUDAPluggableAllocator (see
// megatronapp.memory.use_pool).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "mapp/memory/pool.h"

namespace mapp::torch_ext {

// Installs the CPU pool with `options` (first call) and returns it. Later calls
// return the installed pool; options must then match or ValueError is thrown.
CachingPool& install_cpu_pool(const PoolOptions& options);
// The installed CPU pool, or nullptr.
CachingPool* cpu_pool();
// Puts back the allocator that was active before install_cpu_pool.
void restore_cpu_allocator();

// Recording the CPU pool's operations into an allocation trace file.
void start_cpu_trace();
// Stops recording and writes the trace to `path`; returns the event count.
std::size_t stop_cpu_trace(const std::string& path);

// Host staging buffers: a CPU tensor from a dedicated pool, page-locked when a
// CUDA device is present (also torch.ops.mapp.empty_staging).
CachingPool& staging_pool();
at::Tensor empty_staging(at::IntArrayRef size, at::ScalarType dtype);

#ifdef MAPP_WITH_CUDA_KERNELS
// The CUDA pool of `device` (created on first use by mapp_cuda_malloc).
CachingPool* cuda_pool(int device);
// Options used for CUDA pools created from now on.
void configure_cuda_pools(const PoolOptions& options);
#endif

}  // namespace mapp::torch_ext
