// CUDA kernels of the MoE token dispatcher and the experts' grouped GEMM.
// Raw device pointers and a stream; no torch. Semantics are those of the CPU
// reference in include/mapp/moe/dispatch.h, driven by the same plan arrays
// (copied to the device): assignment_of [rows], row_of [tokens * topk].
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mapp/kernels/cross_entropy.cuh"  // DType

namespace mapp::kernels {

// dst[r] = src[assignment_of[r] / topk] (row_bytes each), zeros for r with -1.
cudaError_t moe_gather_rows(const void* src, std::int64_t row_bytes,
                            const std::int64_t* assignment_of, std::int64_t rows, std::int64_t topk,
                            void* dst, cudaStream_t stream);

// dst[r, :] *= w[assignment_of[r]] (w: float32 [tokens * topk]).
cudaError_t moe_scale_rows(void* dst, DType dtype, std::int64_t h, const float* w,
                           const std::int64_t* assignment_of, std::int64_t rows,
                           cudaStream_t stream);

// out[t] = sum_j w[t, j] * y[row_of[t, j]] (w may be null: 1), float accumulation.
cudaError_t moe_combine_rows(const void* y, DType dtype, std::int64_t h, const float* w,
                             const std::int64_t* row_of, std::int64_t tokens, std::int64_t topk,
                             void* out, cudaStream_t stream);

// gw[a] = <g[a / topk], y[row_of[a]]> (0 when row_of[a] < 0), float32 out.
cudaError_t moe_weight_grads(const void* g, const void* y, DType dtype, std::int64_t h,
                             const std::int64_t* row_of, std::int64_t tokens, std::int64_t topk,
                             float* gw, cudaStream_t stream);

// One cuBLAS grouped GEMM over n experts, row-major: for expert e with m[e]
// rows, C_e [m_e, n_out] = A_e [m_e, k_in] x op(B_e), op(B_e) = B_e^T when
// b_transposed (B_e is [n_out, k_in], a Linear weight) else B_e [k_in, n_out].
// a_ptrs/b_ptrs/c_ptrs: device arrays of n device pointers (caller-owned);
// m: host array, every m[e] >= 1 (leave out experts without rows). dtype float32 (TF32 off),
// float16 or bfloat16 (fp32 accumulation). Returns the cuBLAS status.
cublasStatus_t moe_grouped_gemm(cublasHandle_t handle, DType dtype, int n, const int* m, int n_out,
                                int k_in, bool b_transposed, const void* const* a_ptrs,
                                const void* const* b_ptrs, void* const* c_ptrs);

}  // namespace mapp::kernels
