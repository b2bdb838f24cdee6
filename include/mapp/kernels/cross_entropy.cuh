// CUDA kernels for vocabulary-parallel cross-entropy. Raw pointers and a
// stream; no torch. Semantics are those of mapp::vocab_ce_local_stats
// (include/mapp/tp/cross_entropy.h), which is the reference the GPU tests use.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mapp::kernels {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// logits: device [rows, vocab] of `dtype` with row stride `row_stride`
// elements; target: device int64 [rows]; stats: device float [rows, 3].
// Returns the launch error (cudaSuccess when the kernel was queued).
cudaError_t vocab_ce_local_stats(const void* logits, DType dtype, const std::int64_t* target,
                                 std::int64_t rows, std::int64_t vocab,
                                 std::int64_t row_stride, std::int64_t vocab_start,
                                 float* stats, cudaStream_t stream);

}  // namespace mapp::kernels
