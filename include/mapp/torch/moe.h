// MoE token dispatcher operators (torch.ops.mapp.moe_*; schemas in
// src/torch/moe.cc). Python's megatronapp.moe wraps them in autograd.
//
//   recv, tokens_per_local_expert, plan = moe_dispatch(x [T, h], expert_idx [T, k],
//       num_experts, capacity (-1: dropless), pad, codec ("none" | "int8[:block]" | ...),
//       group_name ("" : no expert parallelism))
//     recv: the rows this rank's experts process, grouped by local expert
//     (then by source rank, then token order); plan: int64 CPU tensor.
//   y_rows = moe_dispatch_with_plan(x, plan, weights?, group)   rows scaled by weights,
//     uncompressed (the combine's backward)
//   out, y_back = moe_combine(y, plan, weights?, group)   out[t] = sum_j w[t,j] y(t,j);
//     y_back: y's rows back at their source, in plan order (for moe_weight_grads)
//   gw = moe_weight_grads(grad_out, y_back, plan)   [T, k]
//   moe_grouped_gemm(x, tokens_per_expert, weights, transposed): one GEMM per
//     expert block of rows (cuBLAS grouped GEMM on CUDA).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace mapp::torch_ext {

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch(
    const at::Tensor& x, const at::Tensor& expert_idx, std::int64_t num_experts,
    std::int64_t capacity, bool pad, const std::string& codec_spec, const std::string& group_name);
at::Tensor moe_dispatch_with_plan(const at::Tensor& x, const at::Tensor& plan,
                                  const c10::optional<at::Tensor>& weights,
                                  const std::string& group_name);
std::tuple<at::Tensor, at::Tensor> moe_combine(const at::Tensor& y, const at::Tensor& plan,
                                               const c10::optional<at::Tensor>& weights,
                                               const std::string& group_name);
at::Tensor moe_weight_grads(const at::Tensor& grad, const at::Tensor& y_back,
                            const at::Tensor& plan);
// [dropped_by_capacity, rows sent (padding included), kept rows per expert...]
std::vector<std::int64_t> moe_plan_stats(const at::Tensor& plan);
at::Tensor moe_grouped_gemm(const at::Tensor& x, at::IntArrayRef tokens_per_expert,
                            at::TensorList weights, bool transposed);

// Elements per row (dim 0) of `t`, also when it has no rows.
inline std::int64_t row_numel(const at::Tensor& t) {
  std::int64_t n = 1;
  for (std::int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// CUDA halves (src/torch/cuda_moe.cc; without CUDA kernels they raise).
at::Tensor moe_gather_rows_cuda(const at::Tensor& x, const std::vector<std::int64_t>& assignment_of,
                                std::int64_t topk, std::int64_t rows);
void moe_scale_rows_cuda(at::Tensor& rows, const at::Tensor& w_f32,
                         const std::vector<std::int64_t>& assignment_of, std::int64_t h);
at::Tensor moe_combine_rows_cuda(const at::Tensor& y_back, const at::Tensor& w_f32,
                                 const std::vector<std::int64_t>& row_of, std::int64_t tokens,
                                 std::int64_t topk, const std::vector<std::int64_t>& out_shape);
at::Tensor moe_weight_grads_cuda(const at::Tensor& grad, const at::Tensor& y_back,
                                 const std::vector<std::int64_t>& row_of, std::int64_t tokens,
                                 std::int64_t topk);
at::Tensor moe_grouped_gemm_cuda(const at::Tensor& x, at::IntArrayRef tokens_per_expert,
                                 at::TensorList weights, bool transposed,
                                 std::int64_t out_features);

}  // namespace mapp::torch_ext
