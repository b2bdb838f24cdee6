// mapp::nn: tensor-parallel layers for C++ trainers (include/mapp/torch/nn.h).
#include "mapp/torch/nn.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iterator>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "mapp/common/check.h"
#include "mapp/torch/ops.h"

namespace mapp::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string group_of(AutogradContext* ctx) { return ctx->saved_data["group"].toStringRef(); }

at::Tensor all_reduce(const at::Tensor& x, const std::string& group) {
  at::Tensor y = x.contiguous().clone();
  torch_ext::all_reduce_sum_(y, group);
  return y;
}

// This rank's slice of `dim` (as given: -1 is the last), contiguous.
at::Tensor split_along(const at::Tensor& x, std::int64_t dim, const std::string& group) {
  const std::int64_t world = torch_ext::group_size(group);
  if (world == 1) return x;
  const std::int64_t d = dim < 0 ? dim + x.dim() : dim;
  MAPP_CHECK(x.size(d) % world == 0, "cannot split dim ", dim, " of size ", x.size(d), " across ",
             world, " tensor-parallel ranks; the size must be divisible by the tensor-parallel ",
             "size");
  return x.chunk(world, d)[torch_ext::group_rank(group)].contiguous();
}

std::int64_t dim_of(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

at::Tensor gather(const at::Tensor& x, std::int64_t dim, const std::string& group) {
  return torch_ext::all_gather(x.contiguous(), dim < 0 ? dim + x.dim() : dim, group);
}

at::Tensor reduce_scatter(const at::Tensor& x, std::int64_t dim, const std::string& group) {
  return torch_ext::reduce_scatter_sum(x.contiguous(), dim < 0 ? dim + x.dim() : dim, group);
}

// The conjugate pairs of Megatron-LM's mappings (nn.h lists them).
struct CopyToTP : torch::autograd::Function<CopyToTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduce(g[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromTP : torch::autograd::Function<ReduceFromTP> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const std::string& group) {
    return all_reduce(x, group);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct ScatterTo : torch::autograd::Function<ScatterTo> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t dim,
                            const std::string& group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return split_along(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gather(g[0], dim_of(ctx), group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherFrom : torch::autograd::Function<GatherFrom> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t dim,
                            const std::string& group, bool reduce_scatter_grad) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["reduce_scatter_grad"] = reduce_scatter_grad;
    return gather(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const at::Tensor d = ctx->saved_data["reduce_scatter_grad"].toBool()
                             ? reduce_scatter(g[0], dim_of(ctx), group_of(ctx))
                             : split_along(g[0], dim_of(ctx), group_of(ctx));
    return {d, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterTo : torch::autograd::Function<ReduceScatterTo> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t dim,
                            const std::string& group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return reduce_scatter(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gather(g[0], dim_of(ctx), group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct VocabParallelCE : torch::autograd::Function<VocabParallelCE> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, const std::string& group,
                            std::int64_t ignore_index) {
    const std::int64_t world = torch_ext::group_size(group);
    const std::int64_t vocab_local = logits.size(-1);
    const std::int64_t vocab_start = torch_ext::group_rank(group) * vocab_local;
    const std::int64_t vocab = vocab_local * world;
    const at::Tensor ignored = target.eq(ignore_index);
    const at::Tensor bad =
        ignored.logical_not().logical_and(target.lt(0).logical_or(target.ge(vocab)));
    const std::string msg = "vocab_parallel_cross_entropy: target ids must lie in [0, " +
                            std::to_string(vocab) +
                            ") (or equal ignore_index=" + std::to_string(ignore_index) + ")";
    if (target.is_cpu()) {
      if (bad.any().item<bool>()) {
        const at::Tensor found = target.masked_select(bad).flatten().slice(0, 0, 4);
        std::string ids;
        for (std::int64_t i = 0; i < found.numel(); ++i)
          ids += (i ? ", " : "") + std::to_string(found[i].item<std::int64_t>());
        TORCH_CHECK_INDEX(false, msg, "; found [", ids, "]");
      }
    } else {  // no host synchronization per microbatch: a device-side assertion
      at::_assert_async(bad.any().logical_not(), msg);
    }
    at::Tensor stats = torch_ext::vocab_ce_local_stats(logits, target, vocab_start).unsqueeze(0);
    if (world > 1) stats = torch_ext::all_gather(stats.contiguous(), 0, group);
    const auto parts = stats.unbind(-1);  // max, sum exp, target logit: each [world, rows...]
    const at::Tensor row_max = std::get<0>(parts[0].max(0));
    const at::Tensor lse = row_max + at::log((parts[1] * at::exp(parts[0] - row_max)).sum(0));
    const at::Tensor loss = (lse - parts[2].sum(0)).masked_fill(ignored, 0.0);
    ctx->save_for_backward({logits, target, lse, ignored});
    ctx->saved_data["vocab_start"] = vocab_start;
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &target = saved[1], &lse = saved[2], &ignored = saved[3];
    const std::int64_t v = logits.size(-1);
    at::Tensor grad = at::exp(logits.to(at::kFloat) - lse.unsqueeze(-1));
    const at::Tensor local = target - ctx->saved_data["vocab_start"].toInt();
    const at::Tensor inside =
        local.ge(0).logical_and(local.lt(v)).logical_and(ignored.logical_not());
    at::Tensor one_hot = at::zeros_like(grad);
    one_hot.scatter_(-1, local.clamp(0, v - 1).unsqueeze(-1),
                     inside.unsqueeze(-1).to(grad.scalar_type()));
    grad = (grad - one_hot) * g[0].masked_fill(ignored, 0.0).unsqueeze(-1);
    return {grad.to(logits.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

InitMethod weight_init(const InitMethod& custom) { return custom ? custom : linear_weight_init; }

// nn.Linear's bias init by default; zeros when a custom weight init is given (as Python).
InitMethod bias_init(const InitMethod& custom, std::int64_t fan_in) {
  if (custom) return [](at::Tensor& b) { b.zero_(); };
  return linear_bias_init(fan_in);
}

std::int64_t divide(std::int64_t n, std::int64_t d, const char* what) {
  MAPP_CHECK(n % d == 0, what, " (", n, ") is not divisible by the tensor-parallel size ", d);
  return n / d;
}

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const std::string& group) {
  return torch_ext::group_size(group) == 1 ? x : CopyToTP::apply(x, group);
}
at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const std::string& group) {
  return torch_ext::group_size(group) == 1 ? x : ReduceFromTP::apply(x, group);
}
at::Tensor gather_from_tensor_parallel(const at::Tensor& x, const std::string& group) {
  return torch_ext::group_size(group) == 1 ? x : GatherFrom::apply(x, -1, group, false);
}
at::Tensor scatter_to_tensor_parallel(const at::Tensor& x, const std::string& group) {
  return torch_ext::group_size(group) == 1 ? x : ScatterTo::apply(x, -1, group);
}
at::Tensor scatter_to_sequence_parallel(const at::Tensor& x, const std::string& group) {
  return torch_ext::group_size(group) == 1 ? x : ScatterTo::apply(x, 0, group);
}
at::Tensor gather_from_sequence_parallel(const at::Tensor& x, const std::string& group,
                                         bool tensor_parallel_output_grad) {
  return torch_ext::group_size(group) == 1
             ? x
             : GatherFrom::apply(x, 0, group, tensor_parallel_output_grad);
}
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& x, const std::string& group) {
  return torch_ext::group_size(group) == 1 ? x : ReduceScatterTo::apply(x, 0, group);
}

namespace {
struct AttrEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;  // the entry is stale once this expired
  ParamAttrs attrs;
};
std::mutex attrs_mu;
std::unordered_map<const c10::TensorImpl*, AttrEntry>& attr_table() {
  static auto* table = new std::unordered_map<const c10::TensorImpl*, AttrEntry>();
  return *table;
}
}  // namespace

void set_param_attrs(const at::Tensor& param, const ParamAttrs& attrs) {
  MAPP_CHECK(param.defined(), "set_param_attrs: undefined tensor");
  std::lock_guard<std::mutex> lock(attrs_mu);
  auto& table = attr_table();
  for (auto it = table.begin(); it != table.end();)  // drop entries of freed tensors
    it = it->second.impl.expired() ? table.erase(it) : std::next(it);
  table.insert_or_assign(
      param.unsafeGetTensorImpl(),
      AttrEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), attrs});
}

ParamAttrs param_attrs(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(attrs_mu);
  const auto& table = attr_table();
  const auto it = table.find(param.unsafeGetTensorImpl());
  if (it == table.end() || it->second.impl.expired()) return {};
  return it->second.attrs;
}

void mark_sequence_parallel(torch::nn::Module& module) {
  for (const auto& p : module.parameters()) {
    ParamAttrs a = param_attrs(p);
    a.sequence_parallel = true;
    set_param_attrs(p, a);
  }
}

// ---- deferred weight gradients ------------------------------------------------------------

namespace {
std::atomic<WeightGradStore*> active_store{nullptr};

// The backward of y = x W^T (+ b): dx now, dW deferred inside a deferring
// backward, db now. Returns {dx, dW, db} (db undefined without a bias).
variable_list linear_backward(AutogradContext* ctx, const at::Tensor& dy, bool has_bias) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor &x = saved[0], &weight = saved[1];
  at::Tensor dx, dw, db;
  if (ctx->needs_input_grad(0)) dx = dy.matmul(weight);
  if (ctx->needs_input_grad(1)) {
    // (a double backward keeps its graph: no in-place accumulation then)
    const bool may_fuse = !at::GradMode::is_enabled();
    auto wgrad = [weight, dy, x, may_fuse] { return linear_weight_grad(weight, dy, x, may_fuse); };
    if (!defer(weight, wgrad)) dw = wgrad();
  }
  if (has_bias && ctx->needs_input_grad(2)) db = dy.reshape({-1, dy.size(-1)}).sum(0);
  return {dx, dw, db};
}

struct DeferrableLinear : torch::autograd::Function<DeferrableLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    ctx->save_for_backward({x, weight});
    return at::linear(x, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return linear_backward(ctx, grads[0], true);
  }
};

struct DeferrableLinearNoBias : torch::autograd::Function<DeferrableLinearNoBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    return at::linear(x, weight);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list g = linear_backward(ctx, grads[0], false);
    g.pop_back();
    return g;
  }
};
}  // namespace

WeightGradStore* set_active_weight_grad_store(WeightGradStore* store) {
  return active_store.exchange(store);
}
DeferringGuard::DeferringGuard(WeightGradStore& store)
    : previous_(set_active_weight_grad_store(&store)) {}
DeferringGuard::~DeferringGuard() { set_active_weight_grad_store(previous_); }

bool defer(const at::Tensor& param, std::function<at::Tensor()> wgrad) {
  WeightGradStore* store = active_store.load();
  if (store == nullptr) return false;
  store->items_.emplace_back(param, std::move(wgrad));
  store->deferred_.push_back(param.unsafeGetTensorImpl());
  return true;
}

bool is_deferred(const at::Tensor& param) {
  const WeightGradStore* store = active_store.load();
  if (store == nullptr) return false;
  const auto* impl = param.unsafeGetTensorImpl();
  return std::find(store->deferred_.begin(), store->deferred_.end(), impl) !=
         store->deferred_.end();
}

namespace {
// A user's hook on the gradient (register_hook: it may change it) or after its
// accumulation (a post-accumulate hook: it reads it) needs
// AccumulateGrad to run with the gradient: no in-place accumulation then.
bool has_grad_hooks(const at::Tensor& weight) {
  namespace impl = torch::autograd::impl;
  if (!impl::hooks(weight).empty() || impl::post_acc_grad_hooks(weight)) return true;
  const auto acc = impl::try_get_grad_accumulator(weight);
  return acc && (!acc->tensor_pre_hooks().empty() || !acc->pre_hooks().empty());
}
}  // namespace

at::Tensor linear_weight_grad(const at::Tensor& weight, const at::Tensor& dy, const at::Tensor& x,
                              bool may_fuse) {
  const at::Tensor dy2 = dy.reshape({-1, dy.size(-1)}), x2 = x.reshape({-1, x.size(-1)});
  if (may_fuse && param_attrs(weight).accumulate_wgrad_in_place && !has_grad_hooks(weight)) {
    const at::Tensor& grad = weight.grad();
    if (grad.defined() && grad.scalar_type() == dy2.scalar_type() &&
        grad.scalar_type() == x2.scalar_type() && grad.device() == dy2.device() &&
        grad.sizes() == at::IntArrayRef({dy2.size(1), x2.size(1)}) && grad.is_contiguous()) {
      at::NoGradGuard no_grad;
      grad.addmm_(dy2.t(), x2);  // .grad += dy^T x
      return {};
    }
  }
  return dy2.t().matmul(x2);
}

void run_weight_grads(WeightGradStore& store) {
  if (store.items_.empty()) return;
  std::vector<at::Tensor> params, grads, in_place;
  for (auto& [p, fn] : store.items_) {
    at::Tensor g = fn();
    if (!g.defined()) {
      in_place.push_back(p);
      continue;
    }
    params.push_back(p);
    grads.push_back(std::move(g));
  }
  store.items_.clear();
  store.deferred_.clear();
  // Already in .grad: what AccumulateGrad would do after adding runs now (the
  // DDP's readiness hooks), as autograd runs it for an undefined gradient.
  for (const at::Tensor& p : in_place)
    if (const auto acc = torch::autograd::impl::try_get_grad_accumulator(p))
      for (const auto& hook : acc->post_hooks()) (*hook)({}, {});
  if (!params.empty()) torch::autograd::backward(params, grads);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!(at::GradMode::is_enabled() && weight.requires_grad()))
    return at::linear(x, weight, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
  return bias.defined() ? DeferrableLinear::apply(x, weight, bias)
                        : DeferrableLinearNoBias::apply(x, weight);
}

at::Tensor sharded_parameter(at::IntArrayRef shape, int partition_dim, int tp_size, int tp_rank,
                             const InitMethod& init, at::ScalarType dtype) {
  at::Tensor full = at::empty(shape, at::kFloat);
  {
    at::NoGradGuard no_grad;
    init(full);
  }
  if (partition_dim >= 0) {
    MAPP_CHECK(full.size(partition_dim) % tp_size == 0, "a parameter of shape ", full.sizes(),
               " cannot be split ", tp_size, " ways along dim ", partition_dim);
    full = full.chunk(tp_size, partition_dim)[tp_rank].clone(at::MemoryFormat::Contiguous);
  }
  at::Tensor param = full.to(dtype);
  if (partition_dim >= 0)
    set_param_attrs(param, {.tensor_parallel = true, .partition_dim = partition_dim});
  return param;
}

void linear_weight_init(at::Tensor& weight) {
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));  // as torch.nn.Linear
}

InitMethod linear_bias_init(std::int64_t fan_in) {
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  return [bound](at::Tensor& b) { b.uniform_(-bound, bound); };
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ColumnParallelLinearOptions& o,
                                                   const dist::ParallelState& state)
    : options(o), group(state.tensor_group()) {
  MAPP_CHECK(!(o.gather_output() && o.sequence_parallel()),
             "ColumnParallelLinear: gather_output cannot be combined with sequence_parallel "
             "(the next layer expects a sequence shard)");
  divide(o.out_features(), state.tp_size(), "ColumnParallelLinear out_features");
  weight = register_parameter(
      "weight", sharded_parameter({o.out_features(), o.in_features()}, 0, state.tp_size(),
                                  state.tp_rank(), weight_init(o.init_method()), o.dtype()));
  if (o.bias())
    bias = register_parameter(
        "bias", sharded_parameter({o.out_features()}, 0, state.tp_size(), state.tp_rank(),
                                  bias_init(o.init_method(), o.in_features()), o.dtype()));
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor in = options.sequence_parallel() ? gather_from_sequence_parallel(x, group)
                                                    : copy_to_tensor_parallel(x, group);
  at::Tensor y = mapp::nn::linear(in, weight, bias);
  return options.gather_output() ? gather_from_tensor_parallel(y, group) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(const RowParallelLinearOptions& o,
                                             const dist::ParallelState& state)
    : options(o), group(state.tensor_group()) {
  MAPP_CHECK(!o.sequence_parallel() || o.input_is_parallel(),
             "RowParallelLinear: sequence_parallel needs input_is_parallel");
  divide(o.in_features(), state.tp_size(), "RowParallelLinear in_features");
  weight = register_parameter(
      "weight", sharded_parameter({o.out_features(), o.in_features()}, 1, state.tp_size(),
                                  state.tp_rank(), weight_init(o.init_method()), o.dtype()));
  if (o.bias())
    bias = register_parameter(
        "bias", sharded_parameter({o.out_features()}, -1, state.tp_size(), state.tp_rank(),
                                  bias_init(o.init_method(), o.in_features()), o.dtype()));
  // Added after the reduce-scatter: each rank sees its sequence shard only.
  if (o.bias() && o.sequence_parallel() && state.tp_size() > 1)
    set_param_attrs(bias, {.sequence_parallel = true});
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor in = options.input_is_parallel() ? x : scatter_to_tensor_parallel(x, group);
  at::Tensor y = mapp::nn::linear(in, weight);
  y = options.sequence_parallel() ? reduce_scatter_to_sequence_parallel(y, group)
                                  : reduce_from_tensor_parallel(y, group);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& o,
                                                       const dist::ParallelState& state)
    : options(o), group(state.tensor_group()) {
  const std::int64_t per = divide(o.num_embeddings(), state.tp_size(),
                                  "VocabParallelEmbedding num_embeddings (vocabulary size)");
  vocab_start = state.tp_rank() * per;
  vocab_end = vocab_start + per;
  weight = register_parameter(
      "weight", sharded_parameter(
                    {o.num_embeddings(), o.embedding_dim()}, 0, state.tp_size(), state.tp_rank(),
                    o.init_method() ? o.init_method() : [](at::Tensor& w) { w.normal_(0.0, 1.0); },
                    o.dtype()));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  if (ids.numel() && ids.is_cpu()) {
    const auto [lo, hi] = at::aminmax(ids);
    MAPP_CHECK(lo.item<std::int64_t>() >= 0 && hi.item<std::int64_t>() < options.num_embeddings(),
               "VocabParallelEmbedding: token ids must lie in [0, ", options.num_embeddings(),
               "), got values in [", lo.item<std::int64_t>(), ", ", hi.item<std::int64_t>(), "]");
  } else if (ids.numel()) {  // no host synchronization per microbatch on a GPU
    at::_assert_async(ids.ge(0).logical_and(ids.lt(options.num_embeddings())).all(),
                      "VocabParallelEmbedding: token ids must lie in [0, " +
                          std::to_string(options.num_embeddings()) + ")");
  }
  at::Tensor out;
  if (torch_ext::group_size(group) > 1) {
    const at::Tensor outside = ids.lt(vocab_start).logical_or(ids.ge(vocab_end));
    const at::Tensor local = (ids - vocab_start).masked_fill(outside, 0);
    out = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  } else {
    out = at::embedding(weight, ids);
  }
  return options.sequence_parallel() ? reduce_scatter_to_sequence_parallel(out, group)
                                     : reduce_from_tensor_parallel(out, group);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const std::string& group, std::int64_t ignore_index) {
  auto tuple = [](c10::IntArrayRef v) {  // as Python prints a shape
    std::string out = "(";
    for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + (v.size() == 1 ? ",)" : ")");
  };
  const c10::IntArrayRef rows = logits.sizes().slice(0, std::max<std::int64_t>(logits.dim() - 1, 0));
  MAPP_CHECK(target.sizes() == rows, "vocab_parallel_cross_entropy: target shape ",
             tuple(target.sizes()), " must equal logits shape without the vocabulary dim ",
             tuple(rows));
  return VocabParallelCE::apply(logits, target, group, ignore_index);
}

}  // namespace mapp::nn
