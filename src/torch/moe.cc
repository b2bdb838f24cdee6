// The MoE token dispatcher as torch operators (torch.ops.mapp.moe_*): the
// routing plan and the row kernels of mapp/moe/dispatch.h (CPU) or
// kernels/moe.cu (CUDA), and the all-to-all with uneven splits over the
// expert-parallel group, traced with its group and sequence number.
//
// The plan travels between the operators as one int64 CPU tensor:
//   [tokens, topk, E, capacity, pad, ep, dropped_by_capacity, rows]
//   rows_per_expert[E], kept_per_expert[E], row_of[tokens*topk],
//   assignment_of[rows], recv_counts[ep * E/ep]  ([source][local expert])
#include "mapp/torch/moe.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "c10d_util.h"
#include "mapp/codec/codec.h"
#include "mapp/common/check.h"
#include "mapp/moe/dispatch.h"

namespace mapp::torch_ext {
namespace {

constexpr std::int64_t kHeader = 8;

struct Plan {
  moe::RoutePlan route;
  std::int64_t ep = 1;
  std::vector<std::int64_t> recv_counts;  // [ep][E/ep] rows from each source per local expert

  std::int64_t local_experts() const { return route.num_experts / ep; }
  // Rows this rank sends to each expert-parallel rank.
  std::vector<std::int64_t> send_splits() const {
    std::vector<std::int64_t> out(ep, 0);
    for (std::int64_t e = 0; e < route.num_experts; ++e)
      out[e / local_experts()] += route.rows_per_expert[e];
    return out;
  }
  // Rows this rank receives from each expert-parallel rank.
  std::vector<std::int64_t> recv_splits() const {
    std::vector<std::int64_t> out(ep, 0);
    for (std::int64_t s = 0; s < ep; ++s)
      for (std::int64_t le = 0; le < local_experts(); ++le)
        out[s] += recv_counts[s * local_experts() + le];
    return out;
  }
  std::vector<std::int64_t> tokens_per_local_expert() const {
    std::vector<std::int64_t> out(local_experts(), 0);
    for (std::int64_t s = 0; s < ep; ++s)
      for (std::int64_t le = 0; le < local_experts(); ++le)
        out[le] += recv_counts[s * local_experts() + le];
    return out;
  }
};

void append(std::vector<std::int64_t>& out, const std::vector<std::int64_t>& v) {
  out.insert(out.end(), v.begin(), v.end());
}

at::Tensor pack(const Plan& p) {
  const auto& r = p.route;
  std::vector<std::int64_t> v{r.tokens,      r.topk, r.num_experts,         r.capacity,
                              r.pad ? 1 : 0, p.ep,   r.dropped_by_capacity, r.rows()};
  append(v, r.rows_per_expert);
  append(v, r.kept_per_expert);
  append(v, r.row_of);
  append(v, r.assignment_of);
  append(v, p.recv_counts);
  return at::tensor(v, at::TensorOptions().dtype(at::kLong));
}

Plan unpack(const at::Tensor& t) {
  MAPP_CHECK(
      t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.numel() >= kHeader,
      "moe: the plan must be the int64 CPU tensor that moe_dispatch returned");
  at::Tensor c = t.contiguous();
  const std::int64_t* d = c.data_ptr<std::int64_t>();
  Plan p;
  auto& r = p.route;
  r.tokens = d[0];
  r.topk = d[1];
  r.num_experts = d[2];
  r.capacity = d[3];
  r.pad = d[4] != 0;
  p.ep = d[5];
  r.dropped_by_capacity = d[6];
  const std::int64_t rows = d[7], E = r.num_experts;
  const std::int64_t want = kHeader + 2 * E + r.tokens * r.topk + rows + E;
  MAPP_CHECK(c.numel() == want && p.ep >= 1 && E % p.ep == 0, "moe: corrupt plan tensor (",
             c.numel(), " entries, expected ", want,
             "); pass the plan moe_dispatch returned, unchanged");
  const std::int64_t* q = d + kHeader;
  auto take = [&q](std::int64_t n) {
    std::vector<std::int64_t> v(q, q + n);
    q += n;
    return v;
  };
  r.rows_per_expert = take(E);
  r.kept_per_expert = take(E);
  r.row_of = take(r.tokens * r.topk);
  r.assignment_of = take(rows);
  p.recv_counts = take(E);
  return p;
}

std::int64_t group_world(const std::string& group_name) {
  return group_name.empty() ? 1 : internal::resolve(group_name)->getSize();
}

at::Tensor long_tensor(const std::vector<std::int64_t>& v, const at::Device& device) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(device);
}

// Rows of `in` ([n, ...], any dtype) exchanged over the group with uneven
// splits (rows per member). Moves bytes: every dtype, and a member with zero
// rows to send or receive takes part like any other (Megatron-LM #1877).
at::Tensor exchange_rows(const at::Tensor& in, const std::vector<std::int64_t>& send,
                         const std::vector<std::int64_t>& recv, const std::string& group_name,
                         const char* op) {
  if (group_name.empty()) return in;
  auto pg = internal::resolve(group_name);
  if (pg->getSize() == 1) return in;
  const std::int64_t rows_out = std::accumulate(recv.begin(), recv.end(), std::int64_t{0});
  auto shape = in.sizes().vec();
  shape[0] = rows_out;
  at::Tensor out = at::empty(shape, in.options());
  const std::int64_t row_bytes = row_numel(in) * in.element_size();
  // One byte column per row byte: splits stay in rows, any dtype moves.
  at::Tensor src = in.contiguous().view(at::kByte).reshape({in.size(0), row_bytes});
  at::Tensor dst = out.view(at::kByte).reshape({rows_out, row_bytes});
  const std::int64_t bytes = src.numel();
  if (auto shm = internal::shm_for(src, group_name)) {  // one node: through shared memory
    std::vector<std::size_t> sb(send.size()), rb(recv.size());
    for (std::size_t i = 0; i < send.size(); ++i) {
      sb[i] = static_cast<std::size_t>(send[i] * row_bytes);
      rb[i] = static_cast<std::size_t>(recv[i] * row_bytes);
    }
    internal::traced(op, group_name, bytes, [&] {
      shm->all_to_all_v(src.data_ptr(), sb.data(), dst.data_ptr(), rb.data(),
                        internal::collective_timeout());
    });
    return out;
  }
  std::vector<std::int64_t> s = send, r = recv;
  internal::run(op, group_name, [&] { return pg->alltoall_base(dst, src, r, s); }, bytes);
  return out;
}

// The float32 rows of `x` by the plan (CPU: the reference gather; CUDA: kernels/moe.cu).
at::Tensor gather(const Plan& p, const at::Tensor& x) {
  const std::int64_t rows = p.route.rows();
  auto shape = x.sizes().vec();
  shape[0] = rows;
  at::Tensor xc = x.contiguous();
  if (x.is_cuda()) return moe_gather_rows_cuda(xc, p.route.assignment_of, p.route.topk, rows);
  at::Tensor out = at::empty(shape, x.options());
  moe::gather_rows(p.route, static_cast<const std::byte*>(xc.data_ptr()),
                   row_numel(xc) * xc.element_size(), static_cast<std::byte*>(out.data_ptr()));
  return out;
}

at::Tensor regroup(const at::Tensor& rows, const std::vector<std::int64_t>& counts, std::int64_t a,
                   std::int64_t b) {
  if (a == 1 || b == 1) return rows;  // [i][j] and [j][i] coincide
  const auto order = moe::regroup_order(counts.data(), a, b);
  return rows.index_select(0, long_tensor(order, rows.device()));
}

std::vector<std::int64_t> transposed(const std::vector<std::int64_t>& m, std::int64_t a,
                                     std::int64_t b) {
  std::vector<std::int64_t> t(m.size());
  for (std::int64_t i = 0; i < a; ++i)
    for (std::int64_t j = 0; j < b; ++j) t[j * a + i] = m[i * b + j];
  return t;
}

// Rows the plan sends, after the exchange, grouped by local expert.
at::Tensor send_to_experts(const Plan& p, at::Tensor rows, const codec::Spec& spec,
                           const std::string& group_name, const char* op) {
  const bool compress = spec.kind != codec::Kind::kNone && p.ep > 1;
  at::Tensor wire = rows;
  const std::int64_t h = row_numel(rows);
  if (compress) {  // each row its own payload: int8 blocks never straddle tokens
    at::Tensor f = rows.to(at::kFloat).contiguous().cpu();
    const auto pb = static_cast<std::int64_t>(codec::encoded_bytes(spec, h));
    wire = at::empty({rows.size(0), pb}, at::TensorOptions().dtype(at::kByte));
    const float* src = f.data_ptr<float>();
    auto* dst = wire.data_ptr<std::uint8_t>();
    at::parallel_for(0, rows.size(0), 64, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) codec::encode(spec, src + r * h, h, dst + r * pb);
    });
    wire = wire.to(rows.device());
  }
  at::Tensor got = exchange_rows(wire, p.send_splits(), p.recv_splits(), group_name, op);
  if (compress) {
    at::Tensor g = got.cpu().contiguous();
    at::Tensor f = at::empty({g.size(0), h}, at::TensorOptions().dtype(at::kFloat));
    const auto pb = g.size(1);
    const auto* src = g.data_ptr<std::uint8_t>();
    float* dst = f.data_ptr<float>();
    at::parallel_for(0, g.size(0), 64, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) codec::decode(spec, src + r * pb, h, dst + r * h);
    });
    auto shape = rows.sizes().vec();
    shape[0] = g.size(0);
    got = f.reshape(shape).to(rows.options());
  }
  return regroup(got, p.recv_counts, p.ep, p.local_experts());
}

void check_tokens(const at::Tensor& x, std::int64_t tokens, const char* op) {
  MAPP_CHECK(x.dim() >= 1 && x.size(0) == tokens, op, ": expected ", tokens,
             " token rows (the routing's), got a tensor of shape ", x.sizes());
}

at::Tensor weights_f32(const c10::optional<at::Tensor>& w, const Plan& p, const char* op) {
  if (!w.has_value()) return at::Tensor();
  MAPP_CHECK(w->numel() == p.route.tokens * p.route.topk, op, ": expected ", p.route.tokens, " x ",
             p.route.topk, " routing weights, got shape ", w->sizes());
  return w->to(at::kFloat).contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch(
    const at::Tensor& x, const at::Tensor& expert_idx, std::int64_t num_experts,
    std::int64_t capacity, bool pad, const std::string& codec_spec, const std::string& group_name) {
  MAPP_CHECK(x.dim() >= 1 && expert_idx.dim() == 2 && expert_idx.size(0) == x.size(0),
             "moe_dispatch: expert_idx must be [tokens, topk] for x of ", x.size(0),
             " tokens; got expert_idx ", expert_idx.sizes(), " and x ", x.sizes());
  const codec::Spec spec = codec::Spec::parse(codec_spec);
  MAPP_CHECK(spec.kind == codec::Kind::kNone || spec.elementwise(),
             "moe_dispatch: --moe-dispatch-compression must be an element-wise codec "
             "(int8[:block], bf16, fp16), got '",
             codec_spec, "'");
  const std::int64_t ep = group_world(group_name);
  MAPP_CHECK(num_experts % ep == 0, "moe_dispatch: ", num_experts,
             " experts do not divide over the expert-parallel group of ", ep,
             " ranks; choose --num-experts divisible by --expert-model-parallel-size");
  at::Tensor idx = expert_idx.to(at::kCPU).to(at::kLong).contiguous();
  Plan p;
  p.ep = ep;
  p.route = moe::plan_routes(idx.data_ptr<std::int64_t>(), idx.size(0), idx.size(1), num_experts,
                             capacity, pad);
  // Each member learns how many rows it gets from every member for each of
  // its experts: an equal-split all-to-all of the per-expert counts.
  at::Tensor counts = at::tensor(p.route.rows_per_expert, at::TensorOptions().dtype(at::kLong));
  if (ep > 1) {
    at::Tensor got = at::empty_like(counts);
    auto pg = internal::resolve(group_name);
    internal::all_to_all_base(got, counts, group_name, *pg, "moe_dispatch_counts");
    counts = got;
  }
  p.recv_counts.assign(counts.data_ptr<std::int64_t>(),
                       counts.data_ptr<std::int64_t>() + counts.numel());
  at::Tensor rows = gather(p, x);
  at::Tensor recv = send_to_experts(p, rows, spec, group_name, "moe_dispatch");
  return {recv, at::tensor(p.tokens_per_local_expert(), at::TensorOptions().dtype(at::kLong)),
          pack(p)};
}

at::Tensor moe_dispatch_with_plan(const at::Tensor& x, const at::Tensor& plan,
                                  const c10::optional<at::Tensor>& weights,
                                  const std::string& group_name) {
  const Plan p = unpack(plan);
  check_tokens(x, p.route.tokens, "moe_dispatch_with_plan");
  MAPP_CHECK(group_world(group_name) == p.ep, "moe_dispatch_with_plan: the plan was made for ",
             p.ep, " expert-parallel ranks, the group has ", group_world(group_name));
  at::Tensor rows = gather(p, x);
  at::Tensor w = weights_f32(weights, p, "moe_dispatch_with_plan");
  if (w.defined() && rows.numel()) {
    const std::int64_t h = row_numel(rows);
    if (rows.is_cuda()) {
      moe_scale_rows_cuda(rows, w, p.route.assignment_of, h);
    } else if (rows.scalar_type() == at::kDouble) {
      at::Tensor wd = w.to(at::kDouble);
      moe::scale_rows(p.route, wd.data_ptr<double>(), h, rows.data_ptr<double>());
    } else if (rows.scalar_type() == at::kFloat) {
      moe::scale_rows(p.route, w.data_ptr<float>(), h, rows.data_ptr<float>());
    } else {
      at::Tensor f = rows.to(at::kFloat);
      moe::scale_rows(p.route, w.data_ptr<float>(), h, f.data_ptr<float>());
      rows.copy_(f);
    }
  }
  return send_to_experts(p, rows, codec::Spec{}, group_name, "moe_dispatch");
}

std::tuple<at::Tensor, at::Tensor> moe_combine(const at::Tensor& y, const at::Tensor& plan,
                                               const c10::optional<at::Tensor>& weights,
                                               const std::string& group_name) {
  const Plan p = unpack(plan);
  const auto tpe = p.tokens_per_local_expert();
  const std::int64_t received = std::accumulate(tpe.begin(), tpe.end(), std::int64_t{0});
  MAPP_CHECK(y.dim() >= 1 && y.size(0) == received, "moe_combine: expected the experts' ", received,
             " output rows (what moe_dispatch delivered), got shape ", y.sizes());
  MAPP_CHECK(group_world(group_name) == p.ep, "moe_combine: the plan was made for ", p.ep,
             " expert-parallel ranks, the group has ", group_world(group_name));
  // [local expert][source] back to [source][local expert], then home.
  at::Tensor back = regroup(y.contiguous(), transposed(p.recv_counts, p.ep, p.local_experts()),
                            p.local_experts(), p.ep);
  at::Tensor y_back =
      exchange_rows(back, p.recv_splits(), p.send_splits(), group_name, "moe_combine");
  at::Tensor w = weights_f32(weights, p, "moe_combine");
  auto shape = y.sizes().vec();
  shape[0] = p.route.tokens;
  const std::int64_t h = row_numel(y);
  if (y.is_cuda())
    return {moe_combine_rows_cuda(y_back, w, p.route.row_of, p.route.tokens, p.route.topk, shape),
            y_back};
  const bool f64 = y.scalar_type() == at::kDouble;
  at::Tensor yb = y_back.to(f64 ? at::kDouble : at::kFloat).contiguous();
  at::Tensor out = at::empty(shape, yb.options());
  if (f64) {
    at::Tensor wd = w.defined() ? w.to(at::kDouble) : w;
    moe::combine_rows(p.route, yb.data_ptr<double>(),
                      wd.defined() ? wd.data_ptr<double>() : nullptr, h, out.data_ptr<double>());
  } else {
    moe::combine_rows(p.route, yb.data_ptr<float>(), w.defined() ? w.data_ptr<float>() : nullptr, h,
                      out.data_ptr<float>());
  }
  return {out.to(y.scalar_type()), y_back};
}

at::Tensor moe_weight_grads(const at::Tensor& grad, const at::Tensor& y_back,
                            const at::Tensor& plan) {
  const Plan p = unpack(plan);
  check_tokens(grad, p.route.tokens, "moe_weight_grads");
  MAPP_CHECK(y_back.dim() >= 1 && y_back.size(0) == p.route.rows(),
             "moe_weight_grads: expected the ", p.route.rows(),
             " rows moe_combine returned, got shape ", y_back.sizes());
  const std::int64_t h = row_numel(grad);
  if (grad.is_cuda())
    return moe_weight_grads_cuda(grad, y_back, p.route.row_of, p.route.tokens, p.route.topk);
  const bool f64 = grad.scalar_type() == at::kDouble;
  const auto dt = f64 ? at::kDouble : at::kFloat;
  at::Tensor g = grad.to(dt).contiguous(), yb = y_back.to(dt).contiguous();
  at::Tensor gw = at::empty({p.route.tokens, p.route.topk}, g.options());
  if (f64) {
    moe::weight_grads(p.route, g.data_ptr<double>(), yb.data_ptr<double>(), h,
                      gw.data_ptr<double>());
  } else {
    moe::weight_grads(p.route, g.data_ptr<float>(), yb.data_ptr<float>(), h, gw.data_ptr<float>());
  }
  return gw;
}

std::vector<std::int64_t> moe_plan_stats(const at::Tensor& plan) {
  const Plan p = unpack(plan);
  std::vector<std::int64_t> out{p.route.dropped_by_capacity, p.route.rows()};
  append(out, p.route.kept_per_expert);
  return out;
}

at::Tensor moe_grouped_gemm(const at::Tensor& x, at::IntArrayRef tokens_per_expert,
                            at::TensorList weights, bool transposed) {
  const auto n = static_cast<std::int64_t>(weights.size());
  MAPP_CHECK(static_cast<std::int64_t>(tokens_per_expert.size()) == n && n >= 1,
             "moe_grouped_gemm: ", tokens_per_expert.size(), " token counts for ", n,
             " expert weights");
  MAPP_CHECK(x.dim() == 2, "moe_grouped_gemm: x must be [rows, in], got ", x.sizes());
  const std::int64_t rows =
      std::accumulate(tokens_per_expert.begin(), tokens_per_expert.end(), std::int64_t{0});
  MAPP_CHECK(rows == x.size(0), "moe_grouped_gemm: the token counts sum to ", rows, " but x has ",
             x.size(0), " rows");
  const std::int64_t in = x.size(1);
  const std::int64_t out_f = transposed ? weights[0].size(0) : weights[0].size(1);
  for (const auto& w : weights) {
    MAPP_CHECK(w.dim() == 2 && w.size(transposed ? 1 : 0) == in &&
                   w.size(transposed ? 0 : 1) == out_f && w.scalar_type() == x.scalar_type() &&
                   w.device() == x.device(),
               "moe_grouped_gemm: every expert weight must be ",
               transposed ? "[out, in] = [" : "[in, out] = [", transposed ? out_f : in, ", ",
               transposed ? in : out_f, "] of ", x.scalar_type(), " on ", x.device(), "; got ",
               w.sizes(), " ", w.scalar_type(), " on ", w.device());
  }
  if (x.is_cuda()) return moe_grouped_gemm_cuda(x, tokens_per_expert, weights, transposed, out_f);
  at::Tensor out = at::empty({rows, out_f}, x.options());
  std::int64_t lo = 0;
  for (std::int64_t e = 0; e < n; ++e) {  // the CPU reference: one GEMM per expert
    const std::int64_t m = tokens_per_expert[e];
    if (m) {
      at::Tensor o = out.narrow(0, lo, m);
      at::mm_out(o, x.narrow(0, lo, m), transposed ? weights[e].t() : weights[e]);
    }
    lo += m;
  }
  return out;
}

#ifndef MAPP_WITH_CUDA_KERNELS
namespace {
[[noreturn]] void no_cuda(const char* op) {
  MAPP_CHECK(false, op, ": this build has no CUDA kernels (rebuild with MAPP_WITH_CUDA=ON)");
}
}  // namespace
at::Tensor moe_gather_rows_cuda(const at::Tensor&, const std::vector<std::int64_t>&, std::int64_t,
                                std::int64_t) {
  no_cuda("moe_dispatch");
}
void moe_scale_rows_cuda(at::Tensor&, const at::Tensor&, const std::vector<std::int64_t>&,
                         std::int64_t) {
  no_cuda("moe_dispatch_with_plan");
}
at::Tensor moe_combine_rows_cuda(const at::Tensor&, const at::Tensor&,
                                 const std::vector<std::int64_t>&, std::int64_t, std::int64_t,
                                 const std::vector<std::int64_t>&) {
  no_cuda("moe_combine");
}
at::Tensor moe_weight_grads_cuda(const at::Tensor&, const at::Tensor&,
                                 const std::vector<std::int64_t>&, std::int64_t, std::int64_t) {
  no_cuda("moe_weight_grads");
}
at::Tensor moe_grouped_gemm_cuda(const at::Tensor&, at::IntArrayRef, at::TensorList, bool,
                                 std::int64_t) {
  no_cuda("moe_grouped_gemm");
}
#endif

}  // namespace mapp::torch_ext

TORCH_LIBRARY_FRAGMENT(mapp, m) {
  m.def(
      "moe_dispatch(Tensor x, Tensor expert_idx, int num_experts, int capacity, bool pad, "
      "str codec, str group_name) -> (Tensor, Tensor, Tensor)",
      &mapp::torch_ext::moe_dispatch);
  m.def("moe_dispatch_with_plan(Tensor x, Tensor plan, Tensor? weights, str group_name) -> Tensor",
        &mapp::torch_ext::moe_dispatch_with_plan);
  m.def("moe_combine(Tensor y, Tensor plan, Tensor? weights, str group_name) -> (Tensor, Tensor)",
        &mapp::torch_ext::moe_combine);
  m.def("moe_weight_grads(Tensor grad, Tensor y_back, Tensor plan) -> Tensor",
        &mapp::torch_ext::moe_weight_grads);
  m.def("moe_plan_stats(Tensor plan) -> int[]", &mapp::torch_ext::moe_plan_stats);
  m.def(
      "moe_grouped_gemm(Tensor x, int[] tokens_per_expert, Tensor[] weights, bool transposed) "
      "-> Tensor",
      &mapp::torch_ext::moe_grouped_gemm);
}
