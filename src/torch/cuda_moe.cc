// CUDA halves of the MoE operators (src/torch/moe.cc): kernels/moe.cu and
// cuBLAS's grouped GEMM on the current stream of the tensors' device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "mapp/common/check.h"
#include "mapp/kernels/moe.cuh"
#include "mapp/torch/moe.h"

namespace mapp::torch_ext {
namespace {

kernels::DType kernel_dtype(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      MAPP_CHECK(false, op, ": CUDA tensors must be float32, float16 or bfloat16, got ", t);
  }
}

void check_launch(cudaError_t err, const char* op) {
  if (err != cudaSuccess) MAPP_FAIL_BACKEND(op, " kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor on_device(const std::vector<std::int64_t>& v, const at::Device& d) {
  // Host to device on the current stream: ordered before the kernels that read it.
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(d, /*non_blocking=*/false);
}

}  // namespace

at::Tensor moe_gather_rows_cuda(const at::Tensor& x, const std::vector<std::int64_t>& assignment_of,
                                std::int64_t topk, std::int64_t rows) {
  c10::cuda::CUDAGuard guard(x.device());
  auto shape = x.sizes().vec();
  shape[0] = rows;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor a = on_device(assignment_of, x.device());
  const std::int64_t row_bytes = row_numel(x) * x.element_size();
  check_launch(
      kernels::moe_gather_rows(x.data_ptr(), row_bytes, a.data_ptr<std::int64_t>(), rows, topk,
                               out.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()),
      "moe gather");
  return out;
}

void moe_scale_rows_cuda(at::Tensor& rows, const at::Tensor& w_f32,
                         const std::vector<std::int64_t>& assignment_of, std::int64_t h) {
  c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor a = on_device(assignment_of, rows.device());
  at::Tensor w = w_f32.to(rows.device());
  check_launch(kernels::moe_scale_rows(rows.data_ptr(), kernel_dtype(rows.scalar_type(), "moe"), h,
                                       w.data_ptr<float>(), a.data_ptr<std::int64_t>(),
                                       rows.size(0), c10::cuda::getCurrentCUDAStream().stream()),
               "moe scale");
}

at::Tensor moe_combine_rows_cuda(const at::Tensor& y_back, const at::Tensor& w_f32,
                                 const std::vector<std::int64_t>& row_of, std::int64_t tokens,
                                 std::int64_t topk, const std::vector<std::int64_t>& out_shape) {
  c10::cuda::CUDAGuard guard(y_back.device());
  at::Tensor y = y_back.contiguous();
  at::Tensor out = at::empty(out_shape, y.options());
  at::Tensor r = on_device(row_of, y.device());
  at::Tensor w = w_f32.defined() ? w_f32.to(y.device()) : w_f32;
  const std::int64_t h = row_numel(out);
  check_launch(kernels::moe_combine_rows(y.data_ptr(), kernel_dtype(y.scalar_type(), "moe_combine"),
                                         h, w.defined() ? w.data_ptr<float>() : nullptr,
                                         r.data_ptr<std::int64_t>(), tokens, topk, out.data_ptr(),
                                         c10::cuda::getCurrentCUDAStream().stream()),
               "moe combine");
  return out;
}

at::Tensor moe_weight_grads_cuda(const at::Tensor& grad, const at::Tensor& y_back,
                                 const std::vector<std::int64_t>& row_of, std::int64_t tokens,
                                 std::int64_t topk) {
  c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor g = grad.contiguous(), y = y_back.to(grad.scalar_type()).contiguous();
  at::Tensor r = on_device(row_of, g.device());
  at::Tensor gw = at::empty({tokens, topk}, g.options().dtype(at::kFloat));
  const std::int64_t h = row_numel(g);
  check_launch(kernels::moe_weight_grads(
                   g.data_ptr(), y.data_ptr(), kernel_dtype(g.scalar_type(), "moe_weight_grads"), h,
                   r.data_ptr<std::int64_t>(), tokens, topk, gw.data_ptr<float>(),
                   c10::cuda::getCurrentCUDAStream().stream()),
               "moe weight grads");
  return gw.to(grad.scalar_type());
}

at::Tensor moe_grouped_gemm_cuda(const at::Tensor& x, at::IntArrayRef tokens_per_expert,
                                 at::TensorList weights, bool transposed,
                                 std::int64_t out_features) {
  c10::cuda::CUDAGuard guard(x.device());
  const kernels::DType dt = kernel_dtype(x.scalar_type(), "moe_grouped_gemm");
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::zeros({x.size(0), out_features}, x.options());
  // Experts with rows only: cuBLAS groups must not be empty.
  std::vector<int> m;
  std::vector<std::int64_t> ptrs_a, ptrs_b, ptrs_c;
  std::vector<at::Tensor> keep;
  std::int64_t lo = 0;
  for (std::size_t e = 0; e < weights.size(); ++e) {
    const std::int64_t rows = tokens_per_expert[e];
    if (rows) {
      at::Tensor w = weights[e].contiguous();
      keep.push_back(w);
      m.push_back(static_cast<int>(rows));
      ptrs_a.push_back(reinterpret_cast<std::int64_t>(static_cast<char*>(xc.data_ptr()) +
                                                      lo * xc.size(1) * xc.element_size()));
      ptrs_b.push_back(reinterpret_cast<std::int64_t>(w.data_ptr()));
      ptrs_c.push_back(reinterpret_cast<std::int64_t>(static_cast<char*>(out.data_ptr()) +
                                                      lo * out_features * out.element_size()));
    }
    lo += rows;
  }
  if (m.empty()) return out;
  std::vector<std::int64_t> all(ptrs_a);
  all.insert(all.end(), ptrs_b.begin(), ptrs_b.end());
  all.insert(all.end(), ptrs_c.begin(), ptrs_c.end());
  at::Tensor dev = on_device(all, x.device());  // three device arrays of pointers
  auto* base = reinterpret_cast<void**>(dev.data_ptr<std::int64_t>());
  const int n = static_cast<int>(m.size());
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to the current stream
  const cublasStatus_t st = kernels::moe_grouped_gemm(
      handle, dt, n, m.data(), static_cast<int>(out_features), static_cast<int>(xc.size(1)),
      transposed, const_cast<const void* const*>(base), const_cast<const void* const*>(base + n),
      base + 2 * n);
  if (st != CUBLAS_STATUS_SUCCESS) {
    MAPP_FAIL_BACKEND("moe_grouped_gemm: cublasGemmGroupedBatchedEx failed with status ",
                      static_cast<int>(st));
  }
  return out;
}

}  // namespace mapp::torch_ext
