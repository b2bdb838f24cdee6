// CUDA side of the fused AdamW; the reference is src/optim/adamw.cc.
#include <algorithm>

#include "mapp/kernels/adamw.cuh"

namespace mapp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTensorsPerLaunch = 32;  // the table travels as a kernel argument (< 4 KiB)

struct Table {
  float* param[kTensorsPerLaunch];
  const float* grad[kTensorsPerLaunch];
  float* exp_avg[kTensorsPerLaunch];
  float* exp_avg_sq[kTensorsPerLaunch];
  std::int64_t numel[kTensorsPerLaunch];
};

// blockIdx.y picks the tensor; the blocks of x stride over its elements.
__global__ void adamw_kernel(Table t, optim::AdamWScalars s) {
  const int k = blockIdx.y;
  float* __restrict__ p = t.param[k];
  const float* __restrict__ g = t.grad[k];
  float* __restrict__ m = t.exp_avg[k];
  float* __restrict__ v = t.exp_avg_sq[k];
  const std::int64_t n = t.numel[k];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float gi = g[i];
    const float mi = __fadd_rn(m[i], __fmul_rn(s.one_minus_b1, __fsub_rn(gi, m[i])));
    const float vi = __fadd_rn(__fmul_rn(v[i], s.b2), __fmul_rn(__fmul_rn(s.one_minus_b2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    p[i] = __fsub_rn(__fmul_rn(p[i], s.decay), __fdiv_rn(__fmul_rn(s.step_size, mi), denom));
  }
}

}  // namespace

cudaError_t adamw_step(float* const* param, const float* const* grad, float* const* exp_avg,
                       float* const* exp_avg_sq, const std::int64_t* numel, int count,
                       const optim::AdamWScalars& s, cudaStream_t stream) {
  for (int first = 0; first < count; first += kTensorsPerLaunch) {
    const int here = std::min(kTensorsPerLaunch, count - first);
    Table t{};
    std::int64_t most = 0;
    for (int k = 0; k < here; ++k) {
      t.param[k] = param[first + k];
      t.grad[k] = grad[first + k];
      t.exp_avg[k] = exp_avg[first + k];
      t.exp_avg_sq[k] = exp_avg_sq[first + k];
      t.numel[k] = numel[first + k];
      most = std::max(most, numel[first + k]);
    }
    if (most == 0) continue;
    const std::int64_t blocks = std::min<std::int64_t>((most + kThreads - 1) / kThreads, 1024);
    adamw_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(here)), kThreads, 0,
                   stream>>>(t, s);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace mapp::kernels
