// torch.ops.mapp.fused_adamw_: AdamW over a list of float32 tensors in one
// pass each (include/mapp/optim/adamw.h on CPU, kernels/adamw.cu on CUDA).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "mapp/common/check.h"
#include "mapp/optim/adamw.h"

#ifdef MAPP_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "mapp/kernels/adamw.cuh"
#endif

namespace mapp::torch_ext {
namespace {

// Every list the same length, every tensor float32, contiguous, on one
// device, and each grad / exp_avg / exp_avg_sq shaped as its parameter.
void check_lists(const at::TensorList params, const at::TensorList grads,
                 const at::TensorList exp_avgs, const at::TensorList exp_avg_sqs) {
  MAPP_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                 exp_avg_sqs.size() == params.size(),
             "fused_adamw_: ", params.size(), " params but ", grads.size(), " grads, ",
             exp_avgs.size(), " exp_avgs and ", exp_avg_sqs.size(), " exp_avg_sqs");
  for (std::size_t i = 0; i < params.size(); ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      MAPP_CHECK(t->scalar_type() == at::kFloat, "fused_adamw_: tensor ", i,
                 " is ", t->scalar_type(), "; the fused AdamW steps float32 tensors (keep fp32 "
                 "master weights, as MixedPrecisionOptimizer does, for bf16/fp16 models)");
      MAPP_CHECK(t->is_contiguous(), "fused_adamw_: tensor ", i, " is not contiguous");
      MAPP_CHECK(t->device() == params[0].device(), "fused_adamw_: tensor ", i, " is on ",
                 t->device(), " but the first parameter is on ", params[0].device());
      MAPP_CHECK(t->sizes() == params[i].sizes(), "fused_adamw_: tensor ", i, " has shape ",
                 t->sizes(), " but its parameter has ", params[i].sizes());
    }
  }
}

optim::AdamWScalars scalars(double lr, double beta1, double beta2, double eps,
                            double weight_decay, std::int64_t step) {
  return optim::adamw_scalars({lr, beta1, beta2, eps, weight_decay}, step);
}

void fused_adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                     double eps, double weight_decay, std::int64_t step) {
  check_lists(params, grads, exp_avgs, exp_avg_sqs);
  const auto s = scalars(lr, beta1, beta2, eps, weight_decay, step);
  for (std::size_t i = 0; i < params.size(); ++i) {
    optim::adamw_step(params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                      exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(),
                      static_cast<std::size_t>(params[i].numel()), s);
  }
}

#ifdef MAPP_WITH_CUDA_KERNELS
void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                      double eps, double weight_decay, std::int64_t step) {
  check_lists(params, grads, exp_avgs, exp_avg_sqs);
  if (params.empty()) return;
  const auto s = scalars(lr, beta1, beta2, eps, weight_decay, step);
  // The current stream of the parameters' device: ordered after the backward
  // (and the gradient reduction) that produced the grads on it.
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<float*> p, m, v;
  std::vector<const float*> g;
  std::vector<std::int64_t> n;
  for (std::size_t i = 0; i < params.size(); ++i) {
    p.push_back(params[i].data_ptr<float>());
    g.push_back(grads[i].data_ptr<float>());
    m.push_back(exp_avgs[i].data_ptr<float>());
    v.push_back(exp_avg_sqs[i].data_ptr<float>());
    n.push_back(params[i].numel());
  }
  const cudaError_t err =
      kernels::adamw_step(p.data(), g.data(), m.data(), v.data(), n.data(),
                          static_cast<int>(p.size()), s,
                          c10::cuda::getCurrentCUDAStream().stream());
  if (err != cudaSuccess)
    MAPP_FAIL_BACKEND("fused_adamw_ kernel launch failed: ", cudaGetErrorString(err));
}
#endif

}  // namespace
}  // namespace mapp::torch_ext

TORCH_LIBRARY_FRAGMENT(mapp, m) {
  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, int step) -> ()");
}

TORCH_LIBRARY_IMPL(mapp, CPU, m) { m.impl("fused_adamw_", &mapp::torch_ext::fused_adamw_cpu); }

#ifdef MAPP_WITH_CUDA_KERNELS
TORCH_LIBRARY_IMPL(mapp, CUDA, m) { m.impl("fused_adamw_", &mapp::torch_ext::fused_adamw_cuda); }
#endif
