#include "mapp/torch/compressed.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

#include "c10d_util.h"
#include "codec_dispatch.h"
#include "mapp/common/check.h"
#include "mapp/torch/ops.h"
#include "mapp/trace/tracer.h"

namespace mapp::torch_ext {
namespace {

using codec::Kind;
using codec::Spec;
using internal::decode;
using internal::encode;
using internal::encode_into;
using internal::resolve;

void check_state(const std::vector<at::Tensor>& state,
                 const std::vector<std::vector<std::int64_t>>& shapes, const Spec& spec) {
  MAPP_CHECK(state.size() == shapes.size(), "codec ", spec.str(), " needs ", shapes.size(),
             " state tensors (see state_shapes), got ", state.size());
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    MAPP_CHECK(state[i].sizes().vec() == shapes[i] && state[i].scalar_type() == at::kFloat &&
                   state[i].is_contiguous(),
               "codec ", spec.str(), " state ", i, " must be a contiguous float32 tensor of shape ",
               at::IntArrayRef(shapes[i]), ", got ", state[i].sizes(), " ", state[i].scalar_type());
  }
}

// ---- the algorithms --------------------------------------------------------------

// Phase 1 of the two-phase scheme: returns this rank's reduced chunk (sum).
at::Tensor two_phase_scatter(const Spec& spec, const at::Tensor& x /*padded f32*/,
                             const at::Tensor* err_worker, const std::string& group,
                             c10d::ProcessGroup& pg, CommStats& st) {
  const std::int64_t world = pg.getSize(), chunk = x.numel() / world;
  const std::int64_t pb = static_cast<std::int64_t>(codec::encoded_bytes(spec, chunk));
  at::Tensor send = at::empty({world * pb}, x.options().dtype(at::kByte));
  for (std::int64_t j = 0; j < world; ++j) {
    at::Tensor e = err_worker ? err_worker->narrow(0, j * chunk, chunk) : at::Tensor();
    encode_into(spec, x.narrow(0, j * chunk, chunk), err_worker ? &e : nullptr,
                send.narrow(0, j * pb, pb));
  }
  at::Tensor recv = at::empty_like(send);
  internal::all_to_all_base(recv, send, group, pg, "compressed reduce-scatter (all-to-all)");
  st.sent_bytes += (world - 1) * pb;
  at::Tensor acc = at::zeros({chunk}, x.options());
  for (std::int64_t i = 0; i < world; ++i) decode(spec, recv.narrow(0, i * pb, pb), acc, true);
  return acc;
}

void two_phase_gather(const Spec& spec, const at::Tensor& chunk, const at::Tensor* err_server,
                      at::Tensor& out /*padded f32*/, const std::string& group,
                      c10d::ProcessGroup& pg, CommStats& st) {
  const std::int64_t world = pg.getSize(), c = chunk.numel();
  at::Tensor payload = encode(spec, chunk, err_server);
  const std::int64_t pb = payload.numel();
  at::Tensor all = at::empty({world * pb}, payload.options());
  internal::all_gather_base(all, payload, group, pg, "compressed all-gather");
  st.sent_bytes += (world - 1) * pb;
  for (std::int64_t i = 0; i < world; ++i) {
    at::Tensor dst = out.narrow(0, i * c, c);
    decode(spec, all.narrow(0, i * pb, pb), dst, false);
  }
}

void plain_all_reduce(at::Tensor& x, const std::string& group, c10d::ProcessGroup& pg,
                      CommStats& st) {
  internal::all_reduce_base(x, group, pg, "all_reduce");
  st.sent_bytes += 2 * (pg.getSize() - 1) * x.numel() * 4 / pg.getSize();
}

// The k entries of largest magnitude of the compensated gradient (CPU: the
// core's codec::topk_encode; CUDA: at::topk), all-gathered as (index, value)
// payloads and scatter-added. What is sent leaves the residual.
void topk_all_reduce(const Spec& spec, at::Tensor& x, at::Tensor& err, const std::string& group,
                     c10d::ProcessGroup& pg, CommStats& st) {
  const std::int64_t n = x.numel(), k = codec::topk_count(spec, n), world = pg.getSize();
  err.add_(x);                    // err holds the compensated gradient x' = x + err
  const std::int64_t pb = 8 * k;  // k int32 indices, then k float32 values
  at::Tensor payload = at::empty({pb}, x.options().dtype(at::kByte));
  if (x.is_cuda()) {
    at::Tensor idx = std::get<1>(at::topk(err.abs(), k, 0, true, false));
    idx = std::get<0>(at::sort(idx));
    payload.narrow(0, 0, 4 * k).copy_(idx.to(at::kInt).view(at::kByte));
    payload.narrow(0, 4 * k, 4 * k).copy_(err.index_select(0, idx).view(at::kByte));
    err.index_fill_(0, idx, 0.0);
  } else {
    codec::topk_encode(err.data_ptr<float>(), n, k, payload.data_ptr<std::uint8_t>());
    const auto* idx = reinterpret_cast<const std::int32_t*>(payload.data_ptr<std::uint8_t>());
    float* e = err.data_ptr<float>();
    for (std::int64_t i = 0; i < k; ++i) e[idx[i]] = 0.f;
  }
  at::Tensor all = at::empty({world * pb}, payload.options());
  internal::all_gather_base(all, payload, group, pg, "top-k all-gather");
  st.sent_bytes += (world - 1) * pb;
  x.zero_();
  for (std::int64_t i = 0; i < world; ++i) {
    at::Tensor p = all.narrow(0, i * pb, pb);
    if (x.is_cuda()) {
      at::Tensor ri = p.narrow(0, 0, 4 * k).view(at::kInt).to(at::kLong);
      x.index_add_(0, ri, p.narrow(0, 4 * k, 4 * k).view(at::kFloat));
    } else {
      codec::topk_decode_add(p.data_ptr<std::uint8_t>(), k, n, x.data_ptr<float>());
    }
  }
}

// Orthonormal columns of p [rows, r] (CPU: the core's codec::gram_schmidt;
// CUDA: a reduced QR). Both give the same column space; PowerSGD's result
// P P^T M does not depend on the columns' signs.
at::Tensor orthonormalize(const at::Tensor& p) {
  if (p.is_cuda()) return std::get<0>(at::linalg_qr(p, "reduced"));
  at::Tensor q = p.contiguous().clone();
  codec::gram_schmidt(q.data_ptr<float>(), q.size(0), q.size(1));
  return q;
}

void powersgd_all_reduce(const Spec& spec, at::Tensor& x, const std::vector<at::Tensor>& state,
                         const std::vector<std::int64_t>& layout, const std::string& group,
                         c10d::ProcessGroup& pg, CommStats& st) {
  const std::int64_t world = pg.getSize();
  at::Tensor err = state[0];
  err.add_(x);  // compensated
  std::vector<at::Tensor> ms, ps;
  const std::size_t m = layout.size() / 3;
  // The gaps between matrices (biases, norms) travel uncompressed: contiguous
  // ranges, gathered with narrow() instead of index masks over the buffer.
  std::vector<std::pair<std::int64_t, std::int64_t>> order;  // (offset, numel)
  for (std::size_t i = 0; i < m; ++i) {
    const std::int64_t off = layout[3 * i], rows = layout[3 * i + 1], cols = layout[3 * i + 2];
    ms.push_back(err.narrow(0, off, rows * cols).view({rows, cols}));
    ps.push_back(at::matmul(ms.back(), state[1 + i]));  // [rows, r]
    order.emplace_back(off, rows * cols);
  }
  std::sort(order.begin(), order.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> gaps;
  std::int64_t cursor = 0;
  for (const auto& [off, len] : order) {
    if (off > cursor) gaps.emplace_back(cursor, off - cursor);
    cursor = std::max(cursor, off + len);
  }
  if (cursor < x.numel()) gaps.emplace_back(cursor, x.numel() - cursor);
  at::Tensor rest;
  if (!gaps.empty()) {
    std::vector<at::Tensor> parts;
    for (const auto& [off, len] : gaps) parts.push_back(err.narrow(0, off, len));
    rest = at::cat(parts);
    for (const auto& [off, len] : gaps) err.narrow(0, off, len).zero_();  // sent exactly
    plain_all_reduce(rest, group, pg, st);
  }
  if (m > 0) {
    std::vector<at::Tensor> flat_ps;
    for (auto& p : ps) flat_ps.push_back(p.reshape(-1));
    at::Tensor pflat = at::cat(flat_ps);
    plain_all_reduce(pflat, group, pg, st);
    std::int64_t at_ = 0;
    std::vector<at::Tensor> local_qs;  // Q_i = M_i^T P, before the reduction
    for (std::size_t i = 0; i < m; ++i) {
      const std::int64_t n = ps[i].numel();
      at::Tensor p = pflat.narrow(0, at_, n).view(ps[i].sizes());
      at_ += n;
      ps[i] = orthonormalize(p);
      local_qs.push_back(at::matmul(ms[i].t(), ps[i]));  // [cols, r]
    }
    std::vector<at::Tensor> flat_qs;
    for (auto& q : local_qs) flat_qs.push_back(q.reshape(-1));
    at::Tensor qflat = at::cat(flat_qs);
    plain_all_reduce(qflat, group, pg, st);
    at_ = 0;
    for (std::size_t i = 0; i < m; ++i) {
      at::Tensor q = state[1 + i];
      const std::int64_t n = q.numel();
      q.copy_(qflat.narrow(0, at_, n).view(q.sizes()));  // sum of Q_i; warm start next call
      at_ += n;
      const std::int64_t off = layout[3 * i];
      x.narrow(0, off, ms[i].numel()).copy_(at::matmul(ps[i], q.t()).reshape(-1));  // sum
      ms[i].sub_(at::matmul(ps[i], local_qs[i].t()));  // residual: M_i - P P^T M_i
    }
  }
  std::int64_t at_rest = 0;
  for (const auto& [off, len] : gaps) {
    x.narrow(0, off, len).copy_(rest.narrow(0, at_rest, len));
    at_rest += len;
  }
}

std::int64_t round_up(std::int64_t a, std::int64_t b) { return (a + b - 1) / b * b; }

}  // namespace

void check_float_1d(const at::Tensor& t, const char* what) {
  MAPP_CHECK(t.dim() == 1 && t.is_contiguous(), what, ": expected a contiguous 1-D tensor, got ",
             t.sizes());
  MAPP_CHECK(at::isFloatingType(t.scalar_type()), what, ": expected floating point, got ",
             t.scalar_type());
}

std::int64_t padded_chunk(const Spec& spec, std::int64_t n, std::int64_t world) {
  return round_up(std::max<std::int64_t>(n, 1), world * spec.alignment()) / world;
}

std::vector<std::vector<std::int64_t>> state_shapes(const Spec& spec, std::int64_t n,
                                                    std::int64_t world,
                                                    const std::vector<std::int64_t>& layout) {
  const std::int64_t c = padded_chunk(spec, n, world);
  switch (spec.kind) {
    case Kind::kInt8:
    case Kind::kOneBit:
      return {{c * world}, {c}};
    case Kind::kTopK:
      return {{n}};
    case Kind::kPowerSGD: {
      MAPP_CHECK(layout.size() % 3 == 0, "layout must hold (offset, rows, cols) triples");
      std::vector<std::vector<std::int64_t>> s{{n}};
      for (std::size_t i = 0; i < layout.size(); i += 3) {
        MAPP_CHECK(layout[i] >= 0 && layout[i] + layout[i + 1] * layout[i + 2] <= n,
                   "layout matrix ", i / 3, " lies outside the buffer of ", n, " elements");
        s.push_back({layout[i + 2], std::min(spec.rank, std::min(layout[i + 1], layout[i + 2]))});
      }
      return s;
    }
    default:
      return {};
  }
}

CommStats compressed_all_reduce(at::Tensor& buf, const Spec& spec,
                                const std::vector<at::Tensor>& state,
                                const std::vector<std::int64_t>& layout, bool average,
                                const std::string& group_name) {
  check_float_1d(buf, "compressed_all_reduce");
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize(), n = buf.numel();
  check_state(state, state_shapes(spec, n, world, layout), spec);
  CommStats st;
  st.raw_bytes = 2 * (world - 1) * n * 4 / std::max<std::int64_t>(world, 1);
  if (world == 1) return st;
  at::Tensor x = buf.scalar_type() == at::kFloat ? buf : buf.to(at::kFloat);
  switch (spec.kind) {
    case Kind::kNone:
      plain_all_reduce(x, group_name, *pg, st);
      break;
    case Kind::kTopK: {
      at::Tensor err = state[0];
      topk_all_reduce(spec, x, err, group_name, *pg, st);
      break;
    }
    case Kind::kPowerSGD:
      powersgd_all_reduce(spec, x, state, layout, group_name, *pg, st);
      break;
    default: {
      const std::int64_t c = padded_chunk(spec, n, world);
      // Work in place when the buffer is already a whole number of chunks.
      at::Tensor padded = x;
      if (c * world != n) {
        padded = at::zeros({c * world}, x.options());
        padded.narrow(0, 0, n).copy_(x);
      }
      const at::Tensor* ew = state.empty() ? nullptr : &state[0];
      const at::Tensor* es = state.empty() ? nullptr : &state[1];
      at::Tensor mine = two_phase_scatter(spec, padded, ew, group_name, *pg, st);
      two_phase_gather(spec, mine, es, padded, group_name, *pg, st);
      if (!padded.is_same(x)) x.copy_(padded.narrow(0, 0, n));
    }
  }
  if (average) x.div_(static_cast<double>(world));
  if (!x.is_same(buf)) buf.copy_(x);
  return st;
}

at::Tensor compressed_reduce_scatter(const at::Tensor& buf, const Spec& spec,
                                     const std::vector<at::Tensor>& state,
                                     const std::vector<std::int64_t>& layout, bool average,
                                     const std::string& group_name, CommStats* stats) {
  check_float_1d(buf, "compressed_reduce_scatter");
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize(), rank = pg->getRank(), n = buf.numel();
  const std::int64_t c = padded_chunk(spec, n, world);
  CommStats st;
  st.raw_bytes = (world - 1) * c * 4;
  at::Tensor padded = at::zeros({c * world}, buf.options().dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(buf);
  at::Tensor mine;
  if (world == 1) {
    mine = padded;
  } else if (spec.kind == Kind::kNone) {
    mine = at::empty({c}, padded.options());
    internal::reduce_scatter_base(mine, padded, group_name, *pg, "reduce_scatter");
    st.sent_bytes += (world - 1) * c * 4;
  } else if (spec.elementwise()) {
    const auto shapes = state_shapes(spec, n, world, layout);
    check_state(state, shapes, spec);
    mine =
        two_phase_scatter(spec, padded, state.empty() ? nullptr : &state[0], group_name, *pg, st);
  } else {  // top-k / PowerSGD compress an all-reduce; keep this rank's chunk
    at::Tensor full = padded.narrow(0, 0, n).clone();
    CommStats inner = compressed_all_reduce(full, spec, state, layout, false, group_name);
    st.sent_bytes += inner.sent_bytes;
    padded.narrow(0, 0, n).copy_(full);
    mine = padded.narrow(0, rank * c, c).clone();
  }
  if (average && world > 1) mine.div_(static_cast<double>(world));
  if (stats) *stats = st;
  return mine;
}

c10::intrusive_ptr<CommWork> compressed_all_reduce_async(at::Tensor buf,
                                                         const CompressedOptions& opts,
                                                         std::vector<at::Tensor> state) {
  check_float_1d(buf, "compressed_all_reduce_async");
  std::vector<at::Tensor> tensors = state;
  tensors.push_back(buf);
  return submit("dp bucket all-reduce", opts.group_name, tensors, [=]() mutable {
    trace::Scope scope("dp bucket all-reduce", trace::Category::kCollective);
    scope.event().bytes = buf.nbytes();
    return compressed_all_reduce(buf, opts.spec, state, opts.layout, opts.average, opts.group_name);
  });
}

c10::intrusive_ptr<CommWork> compressed_reduce_scatter_async(at::Tensor buf, at::Tensor out,
                                                             const CompressedOptions& opts,
                                                             std::vector<at::Tensor> state) {
  check_float_1d(buf, "compressed_reduce_scatter_async");
  std::vector<at::Tensor> tensors = state;
  tensors.push_back(buf);
  tensors.push_back(out);
  return submit("dp bucket reduce-scatter", opts.group_name, tensors, [=]() mutable {
    trace::Scope scope("dp bucket reduce-scatter", trace::Category::kCollective);
    scope.event().bytes = buf.nbytes();
    CommStats st;
    at::Tensor mine = compressed_reduce_scatter(buf, opts.spec, state, opts.layout, opts.average,
                                                opts.group_name, &st);
    out.copy_(mine);
    return st;
  });
}

c10::intrusive_ptr<CommWork> param_all_gather_async(at::Tensor buf, const std::string& group_name) {
  MAPP_CHECK(buf.dim() == 1 && buf.is_contiguous(),
                   "param_all_gather_async: needs a contiguous 1-D parameter buffer, got shape ",
                   buf.sizes());
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize(), rank = pg->getRank();
  MAPP_CHECK(buf.numel() % world == 0, "param_all_gather_async: a buffer of ", buf.numel(),
                   " elements does not split into ", world, " equal chunks (pad it to a multiple)");
  return submit("zero-1 parameter all-gather", group_name, {buf}, [=]() mutable {
    trace::Scope scope("zero-1 parameter all-gather", trace::Category::kCollective);
    scope.event().bytes = buf.nbytes();
    const std::int64_t c = buf.numel() / world;
    // all_gather's own dtype handling (bf16 over Gloo) and shared-memory path.
    buf.copy_(all_gather(buf.narrow(0, rank * c, c).clone(), 0, group_name));
    CommStats st;
    st.raw_bytes = st.sent_bytes = (world - 1) * c * buf.element_size();
    return st;
  });
}

std::vector<at::Tensor> codec_state(const codec::Spec& spec, std::int64_t n, std::int64_t world,
                                    const std::vector<std::int64_t>& layout, std::int64_t seed,
                                    const at::TensorOptions& options) {
  MAPP_CHECK(n >= 0 && world >= 1, "codec_state: need n >= 0 and world >= 1, got n=", n,
             ", world=", world);
  const auto shapes = state_shapes(spec, n, world, layout);
  std::vector<at::Tensor> out;
  // PowerSGD's Q: the same random start on every rank, drawn on the CPU from
  // `seed` (one generator, matrices in layout order) and then moved.
  at::Generator gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  for (std::size_t k = 0; k < shapes.size(); ++k) {
    if (spec.kind == codec::Kind::kPowerSGD && k > 0) {
      out.push_back(at::randn(shapes[k], gen, at::TensorOptions().dtype(at::kFloat))
                        .to(options.dtype(at::kFloat)));
    } else {
      out.push_back(at::zeros(shapes[k], options.dtype(at::kFloat)));
    }
  }
  return out;
}

}  // namespace mapp::torch_ext
