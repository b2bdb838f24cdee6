// Operator registration: schemas in the `mapp` namespace and their CPU /
// device-generic kernels. CUDA kernels register in cuda_ops.cc.
#include "mapp/torch/ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "codec_dispatch.h"
#include "mapp/common/check.h"
#include "mapp/torch/compressed.h"
#include "mapp/torch/ddp.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/shm_p2p.h"
#include "mapp/tp/cross_entropy.h"
#include "mapp/tp/dropout.h"
#include "mapp/tp/softmax.h"

namespace mapp::torch_ext {
namespace {

at::Tensor all_reduce_op(at::Tensor self, const std::string& group_name) {
  all_reduce_sum_(self, group_name);
  return self;
}

at::Tensor vocab_ce_local_stats_cpu(const at::Tensor& logits, const at::Tensor& target,
                                    std::int64_t vocab_start) {
  const bool f64 = logits.scalar_type() == at::kDouble;
  at::Tensor x = logits.to(f64 ? at::kDouble : at::kFloat).contiguous();
  const std::int64_t vocab = x.size(-1);
  at::Tensor t = target.to(at::kLong).contiguous();
  const std::int64_t rows = vocab == 0 ? 0 : x.numel() / vocab;
  auto shape = logits.sizes().vec();
  shape.back() = kVocabCeStatsPerRow;
  at::Tensor stats = at::empty(shape, x.options());
  if (f64) {
    ::mapp::vocab_ce_local_stats(x.data_ptr<double>(), t.data_ptr<std::int64_t>(), rows, vocab,
                                 vocab_start, stats.data_ptr<double>());
  } else {
    ::mapp::vocab_ce_local_stats(x.data_ptr<float>(), t.data_ptr<std::int64_t>(), rows, vocab,
                                 vocab_start, stats.data_ptr<float>());
  }
  return stats;
}

// The kept-value scale of dropout with `threshold`: the mean is exact.
double keep_scale(std::uint32_t threshold) { return 65536.0 / (65536.0 - threshold); }

// Dropout with the counter-based mask of mapp/tp/dropout.h: out = x * keep *
// scale. float / double fused in one pass; other dtypes (bf16, fp16) multiply
// by the generated mask. Threads split the range; the mask does not depend
// on the split. Backward calls the same op on the gradient with the same seed.
template <typename T>
void dropout_into(const at::Tensor& x, std::uint64_t seed, std::uint32_t threshold,
                  at::Tensor& out) {
  const T scale = static_cast<T>(keep_scale(threshold));
  at::parallel_for(0, x.numel(), 1 << 16, [&](std::int64_t begin, std::int64_t end) {
    ::mapp::dropout_apply(seed, threshold, scale, begin, end, x.data_ptr<T>() + begin,
                          out.data_ptr<T>() + begin);
  });
}

at::Tensor fused_dropout_cpu(const at::Tensor& self, double p, std::int64_t seed) {
  const std::uint32_t threshold = ::mapp::dropout_threshold(p);
  const auto useed = static_cast<std::uint64_t>(seed);
  at::Tensor x = self.contiguous();
  if (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) {
    at::Tensor out = at::empty_like(x);
    if (x.scalar_type() == at::kDouble) {
      dropout_into<double>(x, useed, threshold, out);
    } else {
      dropout_into<float>(x, useed, threshold, out);
    }
    return out;
  }
  MAPP_CHECK(at::isFloatingType(x.scalar_type()), "fused_dropout: expected a floating tensor, got ",
             x.scalar_type());
  at::Tensor mask = at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::parallel_for(0, x.numel(), 1 << 16, [&](std::int64_t begin, std::int64_t end) {
    ::mapp::dropout_mask(useed, threshold, begin, end, mask.data_ptr<std::uint8_t>() + begin);
  });
  return x.mul(mask).mul_(keep_scale(threshold));
}

// Scale + causal mask + softmax over the last dim of [..., q_len, cols]
// scores (mapp/tp/softmax.h). float / double run natively; other dtypes in
// float, the result cast back.
void check_softmax_input(const at::Tensor& x, const char* what) {
  MAPP_CHECK(x.dim() >= 2, what, ": expected [..., queries, keys] scores, got ", x.sizes());
  MAPP_CHECK(at::isFloatingType(x.scalar_type()), what, ": expected floating scores, got ",
             x.scalar_type());
  MAPP_CHECK(x.size(-2) >= 1 && x.size(-1) >= x.size(-2), what,
             ": expected at least one query and no more queries than keys, got ", x.sizes());
}

// Calls f(offset, blocks) for runs of whole [q_len, cols] (batch, head) blocks
// of `t`, the runs split over threads; offset is in elements.
template <typename F>
void for_query_blocks(const at::Tensor& t, F&& f) {
  const std::int64_t block = t.size(-2) * t.size(-1);
  at::parallel_for(0, t.numel() / block, 1,
                   [&](std::int64_t b0, std::int64_t b1) { f(b0 * block, b1 - b0); });
}

template <typename T>
void softmax_into(const at::Tensor& x, double scale, at::Tensor& y) {
  const std::int64_t cols = x.size(-1), q_len = x.size(-2);
  for_query_blocks(x, [&](std::int64_t off, std::int64_t blocks) {
    ::mapp::scaled_causal_softmax(x.data_ptr<T>() + off, blocks * q_len, cols, q_len,
                                  static_cast<T>(scale), y.data_ptr<T>() + off);
  });
}

template <typename T>
void softmax_backward_into(const at::Tensor& y, const T* g, double scale, at::Tensor& dx) {
  const std::int64_t cols = y.size(-1), q_len = y.size(-2);
  for_query_blocks(y, [&](std::int64_t off, std::int64_t blocks) {
    ::mapp::scaled_causal_softmax_backward(y.data_ptr<T>() + off, g + off, blocks * q_len, cols,
                                           q_len, static_cast<T>(scale), dx.data_ptr<T>() + off);
  });
}

at::Tensor scaled_causal_softmax_cpu(const at::Tensor& self, double scale) {
  check_softmax_input(self, "scaled_causal_softmax");
  const bool f64 = self.scalar_type() == at::kDouble;
  at::Tensor x = self.to(f64 ? at::kDouble : at::kFloat).contiguous();
  at::Tensor y = at::empty_like(x);
  if (f64) {
    softmax_into<double>(x, scale, y);
  } else {
    softmax_into<float>(x, scale, y);
  }
  return y.scalar_type() == self.scalar_type() ? y : y.to(self.scalar_type());
}

at::Tensor scaled_causal_softmax_backward_cpu(const at::Tensor& grad, const at::Tensor& out,
                                              double scale) {
  check_softmax_input(out, "scaled_causal_softmax_backward");
  MAPP_CHECK(grad.sizes() == out.sizes(), "scaled_causal_softmax_backward: gradient ", grad.sizes(),
             " and output ", out.sizes(), " differ in shape");
  const bool f64 = out.scalar_type() == at::kDouble;
  const auto ft = f64 ? at::kDouble : at::kFloat;
  at::Tensor y = out.to(ft).contiguous(), g = grad.to(ft).contiguous();
  at::Tensor dx = at::empty_like(y);
  if (f64) {
    softmax_backward_into<double>(y, g.data_ptr<double>(), scale, dx);
  } else {
    softmax_backward_into<float>(y, g.data_ptr<float>(), scale, dx);
  }
  return dx.scalar_type() == out.scalar_type() ? dx : dx.to(out.scalar_type());
}

// Softmax then dropout of the probabilities, one (batch, head) block at a time
// so the dropout pass reads the block from cache: (probs, dropped). Element i
// of the flat tensor gets the same mask as fused_dropout(probs, p, seed).
template <typename T>
void softmax_dropout_into(const at::Tensor& x, double scale, std::uint64_t seed,
                          std::uint32_t threshold, at::Tensor& y, at::Tensor& out) {
  const std::int64_t cols = x.size(-1), q_len = x.size(-2), block = q_len * cols;
  const T kept = static_cast<T>(keep_scale(threshold));
  for_query_blocks(x, [&](std::int64_t off, std::int64_t blocks) {
    for (std::int64_t o = off; o < off + blocks * block; o += block) {
      ::mapp::scaled_causal_softmax(x.data_ptr<T>() + o, q_len, cols, q_len, static_cast<T>(scale),
                                    y.data_ptr<T>() + o);
      ::mapp::dropout_apply(seed, threshold, kept, o, o + block, y.data_ptr<T>() + o,
                            out.data_ptr<T>() + o);
    }
  });
}

// Its backward: the dropout mask applied to the gradient, then the softmax
// backward, block by block through one per-thread buffer.
template <typename T>
void softmax_dropout_backward_into(const at::Tensor& g, const at::Tensor& y, double scale,
                                   std::uint64_t seed, std::uint32_t threshold, at::Tensor& dx) {
  const std::int64_t cols = y.size(-1), q_len = y.size(-2), block = q_len * cols;
  const T kept = static_cast<T>(keep_scale(threshold));
  for_query_blocks(y, [&](std::int64_t off, std::int64_t blocks) {
    std::vector<T> kept_grad(static_cast<size_t>(block));
    for (std::int64_t o = off; o < off + blocks * block; o += block) {
      ::mapp::dropout_apply(seed, threshold, kept, o, o + block, g.data_ptr<T>() + o,
                            kept_grad.data());
      ::mapp::scaled_causal_softmax_backward(y.data_ptr<T>() + o, kept_grad.data(), q_len, cols,
                                             q_len, static_cast<T>(scale), dx.data_ptr<T>() + o);
    }
  });
}

void check_float_or_double(const at::Tensor& t, const char* what) {
  MAPP_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, what,
             ": float32 or float64 scores, got ", t.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> scaled_causal_softmax_dropout_cpu(const at::Tensor& self,
                                                                     double scale, double p,
                                                                     std::int64_t seed) {
  check_softmax_input(self, "scaled_causal_softmax_dropout");
  check_float_or_double(self, "scaled_causal_softmax_dropout");
  const std::uint32_t threshold = ::mapp::dropout_threshold(p);
  const auto useed = static_cast<std::uint64_t>(seed);
  at::Tensor x = self.contiguous();
  at::Tensor y = at::empty_like(x), out = at::empty_like(x);
  if (x.scalar_type() == at::kDouble) {
    softmax_dropout_into<double>(x, scale, useed, threshold, y, out);
  } else {
    softmax_dropout_into<float>(x, scale, useed, threshold, y, out);
  }
  return {y, out};
}

at::Tensor scaled_causal_softmax_dropout_backward_cpu(const at::Tensor& grad, const at::Tensor& out,
                                                      double scale, double p, std::int64_t seed) {
  check_softmax_input(out, "scaled_causal_softmax_dropout_backward");
  check_float_or_double(out, "scaled_causal_softmax_dropout_backward");
  MAPP_CHECK(grad.sizes() == out.sizes() && grad.scalar_type() == out.scalar_type(),
             "scaled_causal_softmax_dropout_backward: gradient ", grad.sizes(), " ",
             grad.scalar_type(), " does not match the probabilities ", out.sizes(), " ",
             out.scalar_type());
  const std::uint32_t threshold = ::mapp::dropout_threshold(p);
  const auto useed = static_cast<std::uint64_t>(seed);
  at::Tensor g = grad.contiguous(), y = out.contiguous();
  at::Tensor dx = at::empty_like(y);
  if (y.scalar_type() == at::kDouble) {
    softmax_dropout_backward_into<double>(g, y, scale, useed, threshold, dx);
  } else {
    softmax_dropout_backward_into<float>(g, y, scale, useed, threshold, dx);
  }
  return dx;
}

}  // namespace

void check_ce_shapes(const at::Tensor& logits, const at::Tensor& target) {
  MAPP_CHECK(logits.dim() >= 1, "vocab_ce_local_stats: logits must have a vocabulary dim");
  MAPP_CHECK(target.numel() * logits.size(-1) == logits.numel(),
             "vocab_ce_local_stats: target has ", target.numel(), " elements but logits ",
             logits.sizes(), " have ", logits.size(-1) == 0 ? 0 : logits.numel() / logits.size(-1),
             " rows; target must have the shape of logits without the last dim");
  MAPP_CHECK(!at::isFloatingType(target.scalar_type()),
             "vocab_ce_local_stats: target must hold integer class ids, got ",
             target.scalar_type());
}

at::Tensor vocab_ce_local_stats(const at::Tensor& logits, const at::Tensor& target,
                                std::int64_t vocab_start) {
  check_ce_shapes(logits, target);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mapp::vocab_ce_local_stats", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, std::int64_t)>();
  return op.call(logits, target, vocab_start);
}

// ---- compressed collectives ------------------------------------------------------

using codec::Spec;
using Work = c10::intrusive_ptr<CommWork>;

std::vector<std::int64_t> to_vec(const CommStats& s) { return {s.raw_bytes, s.sent_bytes}; }

CompressedOptions options(const std::string& spec, std::vector<std::int64_t> layout, bool average,
                          const std::string& group) {
  return CompressedOptions{Spec::parse(spec), std::move(layout), average, group};
}

std::vector<std::int64_t> op_all_reduce(at::Tensor buf, const std::string& spec,
                                        std::vector<at::Tensor> state,
                                        std::vector<std::int64_t> layout, bool average,
                                        const std::string& group) {
  return to_vec(compressed_all_reduce(buf, Spec::parse(spec), state, layout, average, group));
}

Work op_all_reduce_async(at::Tensor buf, const std::string& spec, std::vector<at::Tensor> state,
                         std::vector<std::int64_t> layout, bool average, const std::string& group) {
  return compressed_all_reduce_async(buf, options(spec, std::move(layout), average, group),
                                     std::move(state));
}

at::Tensor op_reduce_scatter(const at::Tensor& buf, const std::string& spec,
                             std::vector<at::Tensor> state, std::vector<std::int64_t> layout,
                             bool average, const std::string& group) {
  return compressed_reduce_scatter(buf, Spec::parse(spec), state, layout, average, group, nullptr);
}

Work op_reduce_scatter_async(at::Tensor buf, const std::string& spec, std::vector<at::Tensor> state,
                             std::vector<std::int64_t> layout, at::Tensor out, bool average,
                             const std::string& group) {
  return compressed_reduce_scatter_async(buf, out, options(spec, std::move(layout), average, group),
                                         std::move(state));
}

Work op_param_all_gather_async(at::Tensor buf, const std::string& group) {
  return param_all_gather_async(std::move(buf), group);
}

std::vector<std::int64_t> work_wait(const Work& work, std::int64_t timeout_ms) {
  return to_vec(timeout_ms < 0 ? work->wait() : work->wait(std::chrono::milliseconds(timeout_ms)));
}

std::int64_t op_padded_chunk(const std::string& spec, std::int64_t n, std::int64_t world) {
  return padded_chunk(Spec::parse(spec), n, world);
}

std::vector<std::int64_t> op_state_shapes(const std::string& spec, std::int64_t n,
                                          std::int64_t world, std::vector<std::int64_t> layout) {
  std::vector<std::int64_t> flat;  // (ndim, dims...) per tensor
  for (const auto& s : state_shapes(Spec::parse(spec), n, world, layout)) {
    flat.push_back(static_cast<std::int64_t>(s.size()));
    flat.insert(flat.end(), s.begin(), s.end());
  }
  return flat;
}

std::vector<at::Tensor> op_codec_state(const std::string& spec, std::int64_t n, std::int64_t world,
                                       std::vector<std::int64_t> layout, std::int64_t seed,
                                       std::optional<at::Device> device) {
  return codec_state(Spec::parse(spec), n, world, layout, seed,
                     at::TensorOptions().device(device.value_or(at::kCPU)));
}

using internal::decode;
using internal::encode;

at::Tensor op_encode(const at::Tensor& x, const std::string& spec, std::optional<at::Tensor> err) {
  const Spec s = Spec::parse(spec);
  MAPP_CHECK(s.elementwise(), "codec_encode takes an element-wise codec, got ", spec);
  check_float_1d(x, "codec_encode");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  if (err) {
    MAPP_CHECK(
        err->sizes() == x.sizes() && err->scalar_type() == at::kFloat && err->is_contiguous(),
        "codec_encode: err must be a contiguous float32 tensor shaped like x");
  }
  return encode(s, xf, err ? &*err : nullptr);
}

at::Tensor op_decode(const at::Tensor& payload, const std::string& spec, std::int64_t n) {
  const Spec s = Spec::parse(spec);
  MAPP_CHECK(s.elementwise(), "codec_decode takes an element-wise codec, got ", spec);
  MAPP_CHECK(payload.scalar_type() == at::kByte && payload.is_contiguous() &&
                 payload.numel() == static_cast<std::int64_t>(codec::encoded_bytes(s, n)),
             "codec_decode: a ", spec, " payload of ", n, " elements has ",
             codec::encoded_bytes(s, n), " bytes, got ", payload.numel());
  at::Tensor out = at::empty({n}, payload.options().dtype(at::kFloat));
  decode(s, payload, out, false);
  return out;
}

at::Tensor vocab_ce_local_stats_cpu_checked(const at::Tensor& logits, const at::Tensor& target,
                                            std::int64_t vocab_start) {
  check_ce_shapes(logits, target);
  return vocab_ce_local_stats_cpu(logits, target, vocab_start);
}

std::vector<std::string> registered_ops() {
  std::vector<std::string> names;
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNames()) {
    if (op.name.rfind("mapp::", 0) == 0) names.push_back(op.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool built_with_cuda() {
#ifdef MAPP_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

}  // namespace mapp::torch_ext

TORCH_LIBRARY(mapp, m) {
  m.def("all_reduce_(Tensor(a!) self, str group_name) -> Tensor(a!)");
  // Sums a list over the group through few flat same-dtype buffers (then * scale).
  m.def("coalesced_all_reduce_(Tensor(a!)[] tensors, str group_name, float? scale=None) -> ()",
        [](const std::vector<at::Tensor>& tensors, const std::string& group,
           std::optional<double> scale) {
          mapp::torch_ext::coalesced_all_reduce_(tensors, group, scale);
        });
  m.def("all_gather(Tensor self, int dim, str group_name) -> Tensor");
  m.def("reduce_scatter(Tensor self, int dim, str group_name) -> Tensor");
  m.def("group_size(str group_name) -> int", &mapp::torch_ext::group_size);
  m.def("shm_attach(str group_name, str shm_name, bool create) -> bool",
        &mapp::torch_ext::shm_attach);
  m.def("shm_unlink(str group_name) -> ()", &mapp::torch_ext::shm_unlink);
  m.def("shm_detach(str group_name) -> ()", &mapp::torch_ext::shm_detach);
  m.def("shm_attached(str group_name) -> bool", &mapp::torch_ext::shm_attached);
  // Pipeline send/recv through shared memory (shm_p2p.h).
  using mapp::torch_ext::ShmWork;
  m.class_<ShmWork>("ShmWork")
      .def("wait",
           [](const c10::intrusive_ptr<ShmWork>& w, std::int64_t timeout_ms) {
             w->wait(timeout_ms);
           },
           "", {torch::arg("timeout_ms") = -1})
      .def("is_completed", [](const c10::intrusive_ptr<ShmWork>& w) { return w->is_completed(); });
  m.def(
      "shm_isend(Tensor tensor, str group_name, int dst, int tag) -> "
      "__torch__.torch.classes.mapp.ShmWork",
      &mapp::torch_ext::shm_isend);
  m.def(
      "shm_irecv(Tensor(a!) tensor, str group_name, int src, int tag) -> "
      "__torch__.torch.classes.mapp.ShmWork",
      &mapp::torch_ext::shm_irecv);
  m.def("shm_p2p_attach(str group_name, str shm_name, bool create) -> bool",
        &mapp::torch_ext::shm_p2p_attach);
  m.def("shm_p2p_unlink(str group_name) -> ()", &mapp::torch_ext::shm_p2p_unlink);
  m.def("shm_p2p_detach(str group_name) -> ()", &mapp::torch_ext::shm_p2p_detach);
  m.def("shm_p2p_attached(str group_name) -> bool", &mapp::torch_ext::shm_p2p_attached);
  m.def("shm_p2p_ring_bytes(str group_name) -> int", &mapp::torch_ext::shm_p2p_ring_bytes);
  m.def("vocab_ce_local_stats(Tensor logits, Tensor target, int vocab_start) -> Tensor");
  m.def("fused_dropout(Tensor self, float p, int seed) -> Tensor");
  m.def("scaled_causal_softmax(Tensor self, float scale) -> Tensor");
  m.def("scaled_causal_softmax_backward(Tensor grad, Tensor out, float scale) -> Tensor");
  m.def(
      "scaled_causal_softmax_dropout(Tensor self, float scale, float p, int seed) -> "
      "(Tensor, Tensor)");
  m.def(
      "scaled_causal_softmax_dropout_backward(Tensor grad, Tensor out, float scale, float p, "
      "int seed) -> Tensor");

  // Compressed collectives (compressed.h) and their asynchronous works (comm_engine.h).
  using mapp::torch_ext::CommWork;
  m.class_<CommWork>("CommWork")
      .def("wait", &mapp::torch_ext::work_wait, "", {torch::arg("timeout_ms") = -1})
      .def("is_completed", [](const c10::intrusive_ptr<CommWork>& w) { return w->is_completed(); })
      .def("description", [](const c10::intrusive_ptr<CommWork>& w) { return w->description(); });
  m.def("codec_encode(Tensor x, str spec, Tensor? err=None) -> Tensor",
        &mapp::torch_ext::op_encode);
  m.def("codec_decode(Tensor payload, str spec, int n) -> Tensor", &mapp::torch_ext::op_decode);
  m.def("codec_state_shapes(str spec, int n, int world, int[] layout) -> int[]",
        &mapp::torch_ext::op_state_shapes);
  m.def(
      "codec_state(str spec, int numel, int world=1, int[] layout=[], int seed=0, "
      "Device? device=None) -> Tensor[]",
      &mapp::torch_ext::op_codec_state);
  m.def("codec_padded_chunk(str spec, int n, int world) -> int", &mapp::torch_ext::op_padded_chunk);
  m.def(
      "compressed_all_reduce_(Tensor(a!) buf, str spec, Tensor[] state, int[] layout, "
      "bool average, str group_name) -> int[]",
      &mapp::torch_ext::op_all_reduce);
  m.def(
      "compressed_all_reduce_async(Tensor buf, str spec, Tensor[] state, int[] layout, "
      "bool average, str group_name) -> __torch__.torch.classes.mapp.CommWork",
      &mapp::torch_ext::op_all_reduce_async);
  m.def(
      "compressed_reduce_scatter(Tensor buf, str spec, Tensor[] state, int[] layout, "
      "bool average, str group_name) -> Tensor",
      &mapp::torch_ext::op_reduce_scatter);
  m.def(
      "compressed_reduce_scatter_async(Tensor buf, str spec, Tensor[] state, int[] layout, "
      "Tensor out, bool average, str group_name) -> __torch__.torch.classes.mapp.CommWork",
      &mapp::torch_ext::op_reduce_scatter_async);
  m.def(
      "param_all_gather_async(Tensor(a!) buf, str group_name) -> "
      "__torch__.torch.classes.mapp.CommWork",
      &mapp::torch_ext::op_param_all_gather_async);
  m.def(
      "all_gather_async(Tensor(a!) out, Tensor self, str group_name) -> "
      "__torch__.torch.classes.mapp.CommWork",
      &mapp::torch_ext::all_gather_async);
  m.def(
      "reduce_scatter_async(Tensor(a!) out, Tensor self, str group_name) -> "
      "__torch__.torch.classes.mapp.CommWork",
      &mapp::torch_ext::reduce_scatter_async);
  m.def("wait_comm(__torch__.torch.classes.mapp.CommWork work, int timeout_ms=-1) -> int[]",
        &mapp::torch_ext::work_wait);
  // The global gradient norm and clipping (ddp.h), for lists that may be empty.
  m.def(
      "global_grad_norm(Tensor[] counted, str[] groups, Tensor[] experts, str[] expert_groups, "
      "bool split_experts, Device device) -> float",
      [](const std::vector<at::Tensor>& counted, const std::vector<std::string>& groups,
         const std::vector<at::Tensor>& experts, const std::vector<std::string>& expert_groups,
         bool split_experts, c10::Device device) {
        return mapp::global_grad_norm(counted, groups, experts, expert_groups, split_experts,
                                      device);
      });
  m.def("finish_grad_sums_(Tensor(a!)[] sequence_parallel, str tensor_group, "
        "Tensor(b!)[] embedding, str embedding_group) -> ()",
        [](const std::vector<at::Tensor>& sp, const std::string& tensor_group,
           const std::vector<at::Tensor>& embedding, const std::string& embedding_group) {
          mapp::finish_grad_sums_(sp, tensor_group, embedding, embedding_group);
        });
  m.def("clip_grads_(Tensor(a!)[] grads, float max_norm, float norm) -> ()",
        [](const std::vector<at::Tensor>& grads, double max_norm, double norm) {
          mapp::clip_grads_(grads, max_norm, norm);
        });
  // Tensor-parallel mappings (dim: 0 = sequence, -1 = the last dim).
  m.def("tp_copy_to(Tensor x, str group_name) -> Tensor");
  m.def("tp_reduce_from(Tensor x, str group_name) -> Tensor");
  m.def("tp_scatter_to(Tensor x, int dim, str group_name) -> Tensor");
  m.def("tp_gather_from(Tensor x, int dim, str group_name, bool reduce_scatter_grad) -> Tensor");
  m.def("tp_reduce_scatter_to(Tensor x, str group_name) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, str group_name, "
      "int ignore_index=-100) -> Tensor");
  // y = x W^T + b whose weight gradient a zero-bubble BI defers (nn::linear).
  m.def("deferrable_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

// Collectives are device-generic: c10d picks the backend from the tensor.
TORCH_LIBRARY_IMPL(mapp, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_", &mapp::torch_ext::all_reduce_op);
  m.impl("all_gather", &mapp::torch_ext::all_gather);
  m.impl("reduce_scatter", &mapp::torch_ext::reduce_scatter_sum);
}

// The tensor-parallel mappings and the vocabulary-parallel cross-entropy:
// C++ autograd functions (nn.cc), the one implementation both front-ends use.
TORCH_LIBRARY_IMPL(mapp, CompositeImplicitAutograd, m) {
  m.impl("tp_copy_to", &mapp::nn::copy_to_tensor_parallel);
  m.impl("tp_reduce_from", &mapp::nn::reduce_from_tensor_parallel);
  m.impl("tp_scatter_to", [](const at::Tensor& x, std::int64_t dim, std::string group) {
    MAPP_CHECK(dim == 0 || dim == -1, "tp_scatter_to: dim 0 (sequence) or -1, got ", dim);
    return dim == 0 ? mapp::nn::scatter_to_sequence_parallel(x, group)
                    : mapp::nn::scatter_to_tensor_parallel(x, group);
  });
  m.impl("tp_gather_from",
         [](const at::Tensor& x, std::int64_t dim, std::string group, bool reduce_scatter_grad) {
           MAPP_CHECK(dim == 0 || dim == -1, "tp_gather_from: dim 0 (sequence) or -1, got ", dim);
           MAPP_CHECK(dim == 0 || !reduce_scatter_grad,
                      "tp_gather_from: a reduce-scatter gradient is along dim 0 only");
           return dim == 0 ? mapp::nn::gather_from_sequence_parallel(x, group, reduce_scatter_grad)
                           : mapp::nn::gather_from_tensor_parallel(x, group);
         });
  m.impl("tp_reduce_scatter_to", [](const at::Tensor& x, std::string group) {
    return mapp::nn::reduce_scatter_to_sequence_parallel(x, group);
  });
  m.impl("vocab_parallel_cross_entropy", &mapp::nn::vocab_parallel_cross_entropy);
  m.impl("deferrable_linear",
         [](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
           return mapp::nn::linear(x, weight, bias.value_or(at::Tensor()));
         });
}

TORCH_LIBRARY_IMPL(mapp, CPU, m) {
  m.impl("vocab_ce_local_stats", &mapp::torch_ext::vocab_ce_local_stats_cpu_checked);
  m.impl("fused_dropout", &mapp::torch_ext::fused_dropout_cpu);
  m.impl("scaled_causal_softmax", &mapp::torch_ext::scaled_causal_softmax_cpu);
  m.impl("scaled_causal_softmax_backward", &mapp::torch_ext::scaled_causal_softmax_backward_cpu);
  m.impl("scaled_causal_softmax_dropout", &mapp::torch_ext::scaled_causal_softmax_dropout_cpu);
  m.impl("scaled_causal_softmax_dropout_backward",
         &mapp::torch_ext::scaled_causal_softmax_dropout_backward_cpu);
}
