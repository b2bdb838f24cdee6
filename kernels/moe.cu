// CUDA side of the MoE dispatcher; the reference is src/moe/dispatch.cc.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#include <vector>

#include "mapp/kernels/moe.cuh"

namespace mapp::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void gather_rows_kernel(const unsigned char* src, std::int64_t row_bytes,
                                   const std::int64_t* assignment_of, std::int64_t topk,
                                   unsigned char* dst) {
  const std::int64_t r = blockIdx.x;
  const std::int64_t a = assignment_of[r];
  unsigned char* out = dst + r * row_bytes;
  if ((row_bytes & 3) == 0) {  // whole 32-bit words
    auto* o = reinterpret_cast<unsigned int*>(out);
    const std::int64_t words = row_bytes / 4;
    const auto* in =
        a < 0 ? nullptr : reinterpret_cast<const unsigned int*>(src + (a / topk) * row_bytes);
    for (std::int64_t i = threadIdx.x; i < words; i += blockDim.x) o[i] = in ? in[i] : 0u;
    return;
  }
  const unsigned char* in = a < 0 ? nullptr : src + (a / topk) * row_bytes;
  for (std::int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) out[i] = in ? in[i] : 0;
}

template <typename T>
__device__ float to_f(T v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return static_cast<float>(v);
}

template <typename T>
__device__ T from_f(float v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(v);
  else return static_cast<T>(v);
}

template <typename T>
__global__ void scale_rows_kernel(T* dst, std::int64_t h, const float* w,
                                  const std::int64_t* assignment_of) {
  const std::int64_t r = blockIdx.x;
  const std::int64_t a = assignment_of[r];
  if (a < 0) return;
  const float s = w[a];
  T* row = dst + r * h;
  for (std::int64_t i = threadIdx.x; i < h; i += blockDim.x) row[i] = from_f<T>(to_f(row[i]) * s);
}

template <typename T>
__global__ void combine_rows_kernel(const T* y, std::int64_t h, const float* w,
                                    const std::int64_t* row_of, std::int64_t topk, T* out) {
  const std::int64_t t = blockIdx.x;
  for (std::int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    float acc = 0.f;
    for (std::int64_t j = 0; j < topk; ++j) {  // fixed order: deterministic
      const std::int64_t a = t * topk + j;
      const std::int64_t r = row_of[a];
      if (r >= 0) acc += (w ? w[a] : 1.f) * to_f(y[r * h + i]);
    }
    out[t * h + i] = from_f<T>(acc);
  }
}

template <typename T>
__global__ void weight_grads_kernel(const T* g, const T* y, std::int64_t h,
                                    const std::int64_t* row_of, std::int64_t topk, float* gw) {
  const std::int64_t a = blockIdx.x;
  const std::int64_t r = row_of[a];
  __shared__ float part[kThreads];
  float s = 0.f;
  if (r >= 0) {
    const T* gr = g + (a / topk) * h;
    const T* yr = y + r * h;
    for (std::int64_t i = threadIdx.x; i < h; i += blockDim.x) s += to_f(gr[i]) * to_f(yr[i]);
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int step = blockDim.x / 2; step > 0; step >>= 1) {
    if (static_cast<int>(threadIdx.x) < step) part[threadIdx.x] += part[threadIdx.x + step];
    __syncthreads();
  }
  if (threadIdx.x == 0) gw[a] = part[0];
}

template <typename Launch>
cudaError_t by_dtype(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kFloat32:
      launch(float{});
      break;
    case DType::kFloat16:
      launch(__half{});
      break;
    case DType::kBFloat16:
      launch(__nv_bfloat16{});
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t moe_gather_rows(const void* src, std::int64_t row_bytes,
                            const std::int64_t* assignment_of, std::int64_t rows, std::int64_t topk,
                            void* dst, cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return cudaSuccess;
  gather_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      static_cast<const unsigned char*>(src), row_bytes, assignment_of, topk,
      static_cast<unsigned char*>(dst));
  return cudaGetLastError();
}

cudaError_t moe_scale_rows(void* dst, DType dtype, std::int64_t h, const float* w,
                           const std::int64_t* assignment_of, std::int64_t rows,
                           cudaStream_t stream) {
  if (rows == 0 || h == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    scale_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(static_cast<T*>(dst),
                                                                               h, w, assignment_of);
  });
}

cudaError_t moe_combine_rows(const void* y, DType dtype, std::int64_t h, const float* w,
                             const std::int64_t* row_of, std::int64_t tokens, std::int64_t topk,
                             void* out, cudaStream_t stream) {
  if (tokens == 0 || h == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    combine_rows_kernel<T><<<static_cast<unsigned>(tokens), kThreads, 0, stream>>>(
        static_cast<const T*>(y), h, w, row_of, topk, static_cast<T*>(out));
  });
}

cudaError_t moe_weight_grads(const void* g, const void* y, DType dtype, std::int64_t h,
                             const std::int64_t* row_of, std::int64_t tokens, std::int64_t topk,
                             float* gw, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    weight_grads_kernel<T><<<static_cast<unsigned>(tokens * topk), kThreads, 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(y), h, row_of, topk, gw);
  });
}

cublasStatus_t moe_grouped_gemm(cublasHandle_t handle, DType dtype, int n, const int* m, int n_out,
                                int k_in, bool b_transposed, const void* const* a_ptrs,
                                const void* const* b_ptrs, void* const* c_ptrs) {
  if (n == 0) return CUBLAS_STATUS_SUCCESS;
  // Row-major C = A op(B) is column-major C^T = op(B)^T A^T: cuBLAS's "A" is
  // our B (transposed back when it is a Linear weight), its "B" our A.
  std::vector<cublasOperation_t> ta(n, b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<cublasOperation_t> tb(n, CUBLAS_OP_N);
  std::vector<int> mm(n, n_out), nn(m, m + n), kk(n, k_in);
  std::vector<int> lda(n, b_transposed ? k_in : n_out), ldb(n, k_in), ldc(n, n_out);
  std::vector<int> sizes(n, 1);
  std::vector<float> alpha(n, 1.f), beta(n, 0.f);
  cudaDataType_t t = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (dtype == DType::kFloat16) t = CUDA_R_16F;
  if (dtype == DType::kBFloat16) t = CUDA_R_16BF;
  return cublasGemmGroupedBatchedEx(handle, ta.data(), tb.data(), mm.data(), nn.data(), kk.data(),
                                    alpha.data(), b_ptrs, t, lda.data(), a_ptrs, t, ldb.data(),
                                    beta.data(), c_ptrs, t, ldc.data(), n, sizes.data(), compute);
}

}  // namespace mapp::kernels
