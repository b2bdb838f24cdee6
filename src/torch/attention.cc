// Block attention with log-sum-exp, the kernel of ring attention (context
// parallelism): a query block against one key/value block, forward returning
// (out, lse) so that partial results over key blocks merge exactly, backward
// given the merged out and lse (flash attention's formulation). ATen ops: the
// same code runs on CPU and CUDA tensors.
//
//   attn_block_fwd(q [.., Sq, D], k [.., Sk, D], v [.., Sk, Dv], scale, causal)
//     -> out [.., Sq, Dv], lse [.., Sq] (float32 or the inputs' float64)
//   causal: key j visible to query i when j <= i (square diagonal blocks).
//   attn_block_bwd(dout, q, k, v, out, lse, scale, causal) -> (dq, dk, dv)
//     with out / lse the final (merged) ones: P = exp(S - lse),
//     dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = dS K scale, dK = dS^T Q scale.
#include <ATen/ATen.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "mapp/common/check.h"

namespace mapp::torch_ext {
namespace {

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
               const char* op) {
  MAPP_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), op,
             ": q, k, v must have the same rank (>= 2), got ", q.sizes(), ", ", k.sizes(), ", ",
             v.sizes());
  MAPP_CHECK(q.size(-1) == k.size(-1) && k.size(-2) == v.size(-2), op,
             ": head dims of q and k and key lengths of k and v must agree, got q ", q.sizes(),
             ", k ", k.sizes(), ", v ", v.sizes());
  MAPP_CHECK(!causal || q.size(-2) == k.size(-2), op,
             ": a causal block must be square (diagonal), got ", q.size(-2), " queries and ",
             k.size(-2), " keys");
}

at::Tensor scores(const at::Tensor& q, const at::Tensor& k, double scale, bool causal) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (causal) {
    const auto n = s.size(-1);
    at::Tensor future = at::ones({n, n}, s.options().dtype(at::kBool)).triu_(1);
    s.masked_fill_(future, -std::numeric_limits<double>::infinity());
  }
  return s;
}

at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// On CPU, float32 / bfloat16 blocks of [B, H, S, D] go through ATen's fused
// flash kernel, which returns the log-sum-exp and whose backward takes the
// (merged) output and log-sum-exp, exactly the block contract here; other
// cases use the matmul formulation below.
bool use_cpu_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto t = q.scalar_type();
  return q.device().is_cpu() && q.dim() == 4 && (t == at::kFloat || t == at::kBFloat16) &&
         k.scalar_type() == t && v.scalar_type() == t && q.size(-1) == v.size(-1);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attn_block_fwd(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, double scale, bool causal) {
  check_qkv(q, k, v, causal, "attn_block_fwd");
  if (use_cpu_flash(q, k, v)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {},
                                                                       scale);
    return {out, lse.to(at::kFloat)};
  }
  const auto acc = acc_type(q);
  at::Tensor s = scores(q.to(acc), k.to(acc), scale, causal);
  at::Tensor lse = at::logsumexp(s, -1);
  at::Tensor p = (s - lse.unsqueeze(-1)).exp_();
  at::Tensor out = at::matmul(p, v.to(acc));
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_block_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool causal) {
  check_qkv(q, k, v, causal, "attn_block_bwd");
  if (use_cpu_flash(q, k, v)) {
    const auto t = q.scalar_type();
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(t), q, k, v, out.to(t), lse.to(at::kFloat), 0.0, causal, {}, scale);
  }
  const auto acc = acc_type(q);
  at::Tensor qa = q.to(acc), ka = k.to(acc), va = v.to(acc), g = dout.to(acc);
  at::Tensor p = (scores(qa, ka, scale, causal) - lse.to(acc).unsqueeze(-1)).exp_();
  at::Tensor dv = at::matmul(p.transpose(-2, -1), g);
  at::Tensor delta = (g * out.to(acc)).sum(-1, /*keepdim=*/true);
  at::Tensor ds = p.mul_(at::matmul(g, va.transpose(-2, -1)).sub_(delta));
  at::Tensor dq = at::matmul(ds, ka).mul_(scale);
  at::Tensor dk = at::matmul(ds.transpose(-2, -1), qa).mul_(scale);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

}  // namespace mapp::torch_ext

TORCH_LIBRARY_FRAGMENT(mapp, m) {
  m.def(
      "attn_block_fwd(Tensor q, Tensor k, Tensor v, float scale, bool causal) -> (Tensor, Tensor)",
      &mapp::torch_ext::attn_block_fwd);
  m.def(
      "attn_block_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float scale, bool causal) -> (Tensor, Tensor, Tensor)",
      &mapp::torch_ext::attn_block_bwd);
}
