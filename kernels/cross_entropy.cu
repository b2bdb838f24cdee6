// One thread block per row. Each thread keeps an online (max, sum-exp) pair over
// a strided slice of the row, pairs merge by
//     (m1, s1) + (m2, s2) = (M, s1 exp(m1 - M) + s2 exp(m2 - M)),  M = max(m1, m2)
// first within a warp (shuffles), then across warps (shared memory). The logits
// are read exactly once, in their storage dtype, accumulating in float.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>

#include "mapp/kernels/cross_entropy.cuh"

namespace mapp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  // exp(-inf - -inf) would be NaN for two empty partials; they contribute 0.
  const float a = (m == -FLT_MAX) ? 0.f : s * __expf(m - M);
  const float b = (m2 == -FLT_MAX) ? 0.f : s2 * __expf(m2 - M);
  m = M;
  s = a + b;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ce_stats_kernel(const T* __restrict__ logits, const std::int64_t* __restrict__ target,
                    std::int64_t vocab, std::int64_t row_stride, std::int64_t vocab_start,
                    float* __restrict__ stats) {
  const std::int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  float m = -FLT_MAX, s = 0.f;
  for (std::int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const float v = to_float(x[j]);
    if (v > m) {
      s = s * __expf(m - v) + 1.f;
      m = v;
    } else {
      s += __expf(v - m);
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    merge(m, s, m2, s2);
  }
  __shared__ float warp_m[kWarps], warp_s[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = warp_m[0], S = warp_s[0];
    for (int w = 1; w < kWarps; ++w) merge(M, S, warp_m[w], warp_s[w]);
    const std::int64_t local = target[row] - vocab_start;
    stats[3 * row + 0] = M;
    stats[3 * row + 1] = S;
    stats[3 * row + 2] = (local >= 0 && local < vocab) ? to_float(x[local]) : 0.f;
  }
}

template <typename T>
cudaError_t launch(const void* logits, const std::int64_t* target, std::int64_t rows,
                   std::int64_t vocab, std::int64_t row_stride, std::int64_t vocab_start,
                   float* stats, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffffLL || vocab < 1) return cudaErrorInvalidValue;
  ce_stats_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(logits), target, vocab, row_stride, vocab_start, stats);
  return cudaGetLastError();
}

}  // namespace

cudaError_t vocab_ce_local_stats(const void* logits, DType dtype, const std::int64_t* target,
                                 std::int64_t rows, std::int64_t vocab,
                                 std::int64_t row_stride, std::int64_t vocab_start,
                                 float* stats, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch<float>(logits, target, rows, vocab, row_stride, vocab_start, stats, stream);
    case DType::kFloat16:
      return launch<__half>(logits, target, rows, vocab, row_stride, vocab_start, stats, stream);
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(logits, target, rows, vocab, row_stride, vocab_start, stats,
                                   stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace mapp::kernels
