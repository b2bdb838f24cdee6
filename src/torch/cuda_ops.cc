// CUDA kernels of the `mapp` operators (built only when CUDA is enabled).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "mapp/common/check.h"
#include "mapp/kernels/cross_entropy.cuh"
#include "mapp/tp/cross_entropy.h"

namespace mapp::torch_ext {

void check_ce_shapes(const at::Tensor& logits, const at::Tensor& target);

namespace {

kernels::DType to_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::DType::kFloat32;
    case at::kHalf: return kernels::DType::kFloat16;
    case at::kBFloat16: return kernels::DType::kBFloat16;
    default:
      MAPP_CHECK(false, "vocab_ce_local_stats: CUDA logits must be float32, float16 or "
                        "bfloat16, got ", t);
  }
}

at::Tensor vocab_ce_local_stats_cuda(const at::Tensor& logits, const at::Tensor& target,
                                     std::int64_t vocab_start) {
  check_ce_shapes(logits, target);
  MAPP_CHECK(target.device() == logits.device(), "vocab_ce_local_stats: target is on ",
             target.device(), " but logits are on ", logits.device());
  c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor x = logits.scalar_type() == at::kDouble ? logits.to(at::kFloat) : logits;
  if (x.stride(-1) != 1) x = x.contiguous();
  const std::int64_t vocab = x.size(-1);
  at::Tensor rows2d = x.reshape({-1, vocab});  // a view when the rows are evenly strided
  if (rows2d.size(0) > 1 && rows2d.stride(0) < vocab) rows2d = rows2d.contiguous();
  at::Tensor t = target.to(at::kLong).contiguous();
  auto shape = logits.sizes().vec();
  shape.back() = kVocabCeStatsPerRow;
  at::Tensor stats = at::empty(shape, x.options().dtype(at::kFloat));
  const cudaError_t err = kernels::vocab_ce_local_stats(
      rows2d.data_ptr(), to_kernel_dtype(rows2d.scalar_type()), t.data_ptr<std::int64_t>(),
      rows2d.size(0), vocab, rows2d.size(0) > 1 ? rows2d.stride(0) : vocab, vocab_start,
      stats.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
  if (err != cudaSuccess) {
    MAPP_FAIL_BACKEND("vocab_ce_local_stats kernel launch failed: ", cudaGetErrorString(err));
  }
  return stats;
}

}  // namespace
}  // namespace mapp::torch_ext

TORCH_LIBRARY_IMPL(mapp, CUDA, m) {
  m.impl("vocab_ce_local_stats", &mapp::torch_ext::vocab_ce_local_stats_cuda);
}
