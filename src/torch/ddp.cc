// mapp::DistributedDataParallel and mapp::DistributedOptimizer
// (include/mapp/torch/ddp.h): the Python distributed/data_parallel.py / optimizer/optimizer.py
// mechanisms, bucket for bucket.
#include "mapp/torch/ddp.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mapp/codec/codec.h"
#include "mapp/common/check.h"
#include "mapp/torch/checkpoint_engine.h"  // crc32
#include "mapp/torch/compressed.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"
#include "mapp/trace/tracer.h"

namespace mapp {
namespace {

// A post hook on a parameter's gradient accumulator (torch's Reducer hooks
// the same place): added to autograd's node, so a user's own hooks stay.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<bool> alive, GradReducer* reducer, std::size_t bucket,
            std::size_t slot)
      : alive_(std::move(alive)), reducer_(reducer), bucket_(bucket), slot_(slot) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (!alive_.expired()) reducer_->on_grad_ready(bucket_, slot_);
    return outputs;
  }

 private:
  std::weak_ptr<bool> alive_;
  GradReducer* reducer_;
  std::size_t bucket_, slot_;
};

using Pairs = std::vector<std::pair<at::Tensor, at::Tensor>>;  // (param, its gradient or shard)

// finish_grad_sums_ over the pairs' gradients, chosen by their parameters' attributes.
void add_partial_sums(const Pairs& pairs, const dist::ParallelState& st) {
  std::vector<at::Tensor> sp, shared;
  for (const auto& [p, g] : pairs) {
    const nn::ParamAttrs a = nn::param_attrs(p);
    if (a.sequence_parallel && st.tp_size() > 1) sp.push_back(g);
    if (a.shared_embedding && st.pp_size() > 1 && !st.embedding_group().empty())
      shared.push_back(g);
  }
  finish_grad_sums_(sp, sp.empty() ? "" : st.tensor_group(), shared,
                    shared.empty() ? "" : st.embedding_group());
}

// Which gradients count (tensor-parallel shards on every tensor rank,
// replicated parameters on tensor rank 0, not the last stage's tied-embedding
// replica), then the global norm and clipping. Returns the norm before clipping.
double clip_by_global_norm(const Pairs& pairs, const dist::ParallelState& st,
                           const std::vector<std::string>& groups, double max_norm) {
  std::vector<at::Tensor> counted, all;
  for (const auto& [p, g] : pairs) {
    all.push_back(g);
    const nn::ParamAttrs a = nn::param_attrs(p);
    if (a.shared_embedding_replica) continue;  // the first stage counts it
    if (a.tensor_parallel || st.tp_rank() == 0) counted.push_back(g);
  }
  const at::Device device = all.empty() ? at::Device(at::kCPU) : all.front().device();
  const double norm = global_grad_norm(counted, groups, {}, {}, false, device);
  clip_grads_(all, max_norm, norm);
  return norm;
}

}  // namespace

void finish_grad_sums_(const std::vector<at::Tensor>& sequence_parallel,
                       const std::string& tensor_group, const std::vector<at::Tensor>& embedding,
                       const std::string& embedding_group) {
  at::NoGradGuard no_grad;
  if (!sequence_parallel.empty() && !tensor_group.empty())
    torch_ext::coalesced_all_reduce_(sequence_parallel, tensor_group);
  if (embedding.empty() || embedding_group.empty()) return;
  if (embedding.size() == 2) {  // both ends of zb-v's wave on this rank
    embedding[0].add_(embedding[1]);
    embedding[1].copy_(embedding[0]);
    return;
  }
  torch_ext::coalesced_all_reduce_(embedding, embedding_group);
}

namespace {
at::Tensor sum_of_squares(const std::vector<at::Tensor>& grads, at::Device device) {
  at::Tensor total = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  if (!grads.empty()) {
    std::vector<at::Tensor> detached;
    detached.reserve(grads.size());
    for (const auto& g : grads) detached.push_back(g.detach());
    total += at::stack(at::_foreach_norm(detached)).to(at::kDouble).square().sum();
  }
  return total;
}
}  // namespace

double global_grad_norm(const std::vector<at::Tensor>& counted,
                        const std::vector<std::string>& groups,
                        const std::vector<at::Tensor>& experts,
                        const std::vector<std::string>& expert_groups, bool split_experts,
                        at::Device device) {
  at::NoGradGuard no_grad;
  at::Tensor total = sum_of_squares(counted, device);
  for (const auto& group : groups)
    if (torch_ext::group_size(group) > 1) torch_ext::all_reduce_sum_(total, group);
  if (split_experts) {
    at::Tensor ex = sum_of_squares(experts, device);
    for (const auto& group : expert_groups)
      if (torch_ext::group_size(group) > 1) torch_ext::all_reduce_sum_(ex, group);
    total += ex;
  }
  return std::sqrt(total.item<double>());  // the one host synchronization
}

void clip_grads_(const std::vector<at::Tensor>& grads, double max_norm, double norm) {
  at::NoGradGuard no_grad;
  if (max_norm > 0 && norm > max_norm && !grads.empty())
    at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
}

double finish_gradients(const std::vector<DistributedDataParallel*>& chunks,
                        const dist::ParallelState& state, double max_norm) {
  at::NoGradGuard no_grad;
  Pairs pairs;
  for (DistributedDataParallel* ddp : chunks) {
    MAPP_CHECK(!ddp->uses_distributed_optimizer(),
               "finish_gradients: the model has a DistributedOptimizer; use its clip_grad_norm");
    ddp->finish_grad_sync();
    for (const auto& p : ddp->module().parameters())
      if (p.grad().defined()) pairs.emplace_back(p, p.grad());
  }
  add_partial_sums(pairs, state);
  return clip_by_global_norm(pairs, state, {state.model_group()}, max_norm);
}

double finish_gradients(DistributedDataParallel& ddp, const dist::ParallelState& state,
                        double max_norm) {
  return finish_gradients(std::vector<DistributedDataParallel*>{&ddp}, state, max_norm);
}

// ---- GradReducer ----------------------------------------------------------------------

GradReducer::GradReducer(std::vector<ReducerParam> params, ReducerOptions options)
    : options_(std::move(options)), alive_(std::make_shared<bool>(true)) {
  MAPP_CHECK(options_.bucket_bytes > 0, "GradReducer: the bucket size must be positive, got ",
             options_.bucket_bytes, " bytes");
  MAPP_CHECK(!options_.group.empty(), "GradReducer: no process group");
  codec::Spec::parse(options_.compression);  // a clear error for an unknown codec, here
  if (options_.expert_group.empty()) options_.expert_group = options_.group;
  at::NoGradGuard no_grad;
  std::reverse(params.begin(), params.end());  // backward produces the last layers' first
  // Open buckets by key, in order of first appearance.
  struct Open {
    at::ScalarType dtype;
    bool exact, expert;
    std::vector<at::Tensor> params;
    std::int64_t bytes = 0;
  };
  std::vector<Open> open;
  for (auto& rp : params) {
    MAPP_CHECK(rp.param.requires_grad() && rp.param.is_leaf(),
               "GradReducer: parameters must be leaves that require grad");
    if (rp.own_bucket) {
      add_bucket({rp.param}, false, rp.expert);
      continue;
    }
    const at::ScalarType dtype = rp.param.scalar_type();
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) {
      return o.dtype == dtype && o.exact == rp.exact && o.expert == rp.expert;
    });
    if (it == open.end()) it = open.insert(open.end(), Open{dtype, rp.exact, rp.expert, {}, 0});
    it->params.push_back(rp.param);
    it->bytes += rp.param.numel() * rp.param.element_size();
    if (it->bytes >= options_.bucket_bytes) {
      add_bucket(std::move(it->params), it->exact, it->expert);
      it->params.clear();
      it->bytes = 0;
    }
  }
  for (auto& o : open)
    if (!o.params.empty()) add_bucket(std::move(o.params), o.exact, o.expert);
  hook_params();
}

GradReducer::~GradReducer() {
  alive_.reset();  // hooks that fire later do nothing
  for (std::size_t i = 0; i < accumulators_.size(); ++i)
    if (accumulators_[i]) accumulators_[i]->del_post_hook(hook_keys_[i]);
  for (auto& b : buckets_)
    for (auto* work : {&b.handle, &b.gather})
      if (*work) {
        try {
          (*work)->wait();
        } catch (...) {  // a destructor must not throw; the error was the step's
        }
      }
}

void GradReducer::add_bucket(std::vector<at::Tensor> params, bool exact, bool expert) {
  GradBucket b;
  b.index = static_cast<int>(buckets_.size());
  for (const auto& p : params) {
    b.offsets.push_back(b.numel);
    if (p.dim() == 2) b.layout.insert(b.layout.end(), {b.numel, p.size(0), p.size(1)});
    b.numel += p.numel();
  }
  b.params = std::move(params);
  b.dtype = b.params[0].scalar_type();
  const at::ScalarType grad_dtype = options_.grad_reduce_in_fp32 ? at::kFloat : b.dtype;
  b.grad_data = at::zeros({b.numel}, b.params[0].options().dtype(grad_dtype).requires_grad(false));
  b.exact = exact;
  b.expert = expert;
  b.group = expert ? options_.expert_group : options_.group;
  b.ready.assign(b.params.size(), 0);
  if (b.keeps_main_grad())
    for (std::size_t i = 0; i < b.params.size(); ++i)
      b.main_grads.push_back(b.grad_data.slice(0, b.offsets[i], b.offsets[i] + b.params[i].numel())
                                 .view(b.params[i].sizes()));
  // Where .grad is the bucket's view, linear() may add weight gradients into it.
  if (options_.gradient_accumulation_fusion && !b.keeps_main_grad())
    for (const auto& p : b.params) {
      nn::ParamAttrs a = nn::param_attrs(p);
      a.accumulate_wgrad_in_place = true;
      nn::set_param_attrs(p, a);
    }
  buckets_.push_back(std::move(b));
  attach_grads(buckets_.back(), /*zero=*/true);
}

void GradReducer::hook_params() {
  std::size_t k = 0;
  for (const auto& b : buckets_) k += b.params.size();
  accumulators_.resize(k);
  hook_keys_.resize(k);
  k = 0;
  for (std::size_t i = 0; i < buckets_.size(); ++i)
    for (std::size_t j = 0; j < buckets_[i].params.size(); ++j, ++k) {
      const at::Tensor& p = buckets_[i].params[j];
      // (a parameter frozen since has none: its bucket is submitted at the finish)
      std::shared_ptr<torch::autograd::Node> acc =
          p.requires_grad() ? torch::autograd::impl::grad_accumulator(p) : nullptr;
      if (acc == accumulators_[k]) continue;
      if (accumulators_[k]) accumulators_[k]->del_post_hook(hook_keys_[k]);
      if (acc) hook_keys_[k] = acc->add_post_hook(std::make_unique<ReadyHook>(alive_, this, i, j));
      accumulators_[k] = std::move(acc);
    }
}

void GradReducer::attach_grads(GradBucket& b, bool zero) {
  if (b.keeps_main_grad()) return;  // the main gradients are views for good
  for (std::size_t i = 0; i < b.params.size(); ++i) {
    auto& p = b.params[i];
    const at::Tensor view =
        b.grad_data.slice(0, b.offsets[i], b.offsets[i] + p.numel()).view(p.sizes());
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) {
      if (zero) view.zero_();
    } else if (grad.data_ptr() != view.data_ptr()) {
      view.copy_(grad);  // the user replaced .grad: adopt its values
    } else {
      continue;
    }
    grad = view;
  }
}

void GradReducer::prepare_forward() {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& b : buckets_) {
    // A reduction still in flight (a synchronized backward never finished)
    // writes into the bucket: waited for, not abandoned to race the next backward.
    if (b.handle) {
      c10::intrusive_ptr<torch_ext::CommWork> work = std::move(b.handle);
      b.handle.reset();
      b.stats = work->wait();
    }
    attach_grads(b, /*zero=*/true);
    std::fill(b.ready.begin(), b.ready.end(), 0);
    b.n_ready = 0;
  }
  next_bucket_ = 0;
  started_ = false;
  hook_params();
}

std::string GradReducer::spec() const {
  if (options_.compression == "none" || sync_steps_ < options_.compression_start_iter)
    return "none";
  return options_.compression;
}

std::string GradReducer::spec_for(const GradBucket& b) const { return b.exact ? "none" : spec(); }

std::vector<at::Tensor>& GradReducer::codec_state_of(GradBucket& b, const std::string& spec) {
  auto it = b.state.find(spec);
  if (it == b.state.end())
    it = b.state
             .emplace(spec, torch_ext::codec_state(codec::Spec::parse(spec), b.grad_data.numel(),
                                                   torch_ext::group_size(b.group), b.layout,
                                                   b.index,
                                                   at::TensorOptions().device(b.grad_data.device())))
             .first;
  return it->second;
}

void GradReducer::on_grad_ready(std::size_t bucket, std::size_t slot) {
  GradBucket& b = buckets_[bucket];
  const at::Tensor& param = b.params[slot];
  if (b.keeps_main_grad()) {
    at::Tensor& grad = param.mutable_grad();
    if (grad.defined()) {
      at::NoGradGuard no_grad;
      b.main_grads[slot].add_(grad);  // float32 accumulation
      grad = at::Tensor();
    }
  }
  // A weight gradient put aside by a zero-bubble BI is not ready: its W is.
  if (!sync_ || nn::is_deferred(param)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!started_) {
    started_ = true;
    if (finish_at_backward_end_)
      torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_grad_sync(); });
  }
  if (!b.ready[slot]) {
    b.ready[slot] = 1;
    ++b.n_ready;
  }
  if (!options_.overlap_grad_reduce) return;
  // Strictly in order, so every rank issues the same sequence of collectives.
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].n_ready == buckets_[next_bucket_].params.size())
    launch(buckets_[next_bucket_++]);
}

void GradReducer::launch(GradBucket& b) {
  at::NoGradGuard no_grad;
  const std::string spec = spec_for(b);
  std::vector<at::Tensor> state = codec_state_of(b, spec);
  // Experts: summed over the ep ranks' tokens by the dispatcher already; the
  // reduction averages over edp, and edp/dp more makes it 1/dp.
  if (b.expert && options_.expert_scale != 1.0) b.grad_data.mul_(options_.expert_scale);
  torch_ext::CompressedOptions opts{codec::Spec::parse(spec), b.layout, /*average=*/true, b.group};
  b.handle = zero_ ? torch_ext::compressed_reduce_scatter_async(b.grad_data, b.shard,
                                                                std::move(opts), std::move(state))
                   : torch_ext::compressed_all_reduce_async(b.grad_data, std::move(opts),
                                                            std::move(state));
}

void GradReducer::finish_grad_sync() {
  // Parameters no forward touched this step (an expert without tokens) may
  // still have their gather in flight: finished before the step's collectives.
  finish_param_sync();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) return;  // no synchronized backward since the last finish
    started_ = false;
    while (next_bucket_ < buckets_.size()) launch(buckets_[next_bucket_++]);
    next_bucket_ = 0;
    for (auto& b : buckets_) {
      std::fill(b.ready.begin(), b.ready.end(), 0);
      b.n_ready = 0;
    }
  }
  torch_ext::CommStats step;
  trace::Scope scope("dp_wait", trace::Category::kCollective);  // the training thread waits
  scope.event().lane = trace::kMainLane;
  for (auto& b : buckets_) {
    if (!b.handle) continue;
    c10::intrusive_ptr<torch_ext::CommWork> work = std::move(b.handle);
    b.handle.reset();
    b.stats = work->wait();
    step.raw_bytes += b.stats.raw_bytes;
    step.sent_bytes += b.stats.sent_bytes;
  }
  step_stats_ = step;
  ++sync_steps_;
}

void GradReducer::zero_grad_buffer() {
  MAPP_CHECK(!started_, "GradReducer: zero_grad_buffer during a step whose reduction is not ",
             "finished (call finish_grad_sync first)");
  for (auto& b : buckets_) b.grad_data.zero_();
}

void GradReducer::enable_distributed_optimizer() {
  if (zero_) return;
  zero_ = true;
  at::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    const std::string spec = b.exact ? "none" : options_.compression;
    const std::int64_t world = torch_ext::group_size(b.group);
    const std::int64_t padded =
        torch_ext::padded_chunk(codec::Spec::parse(spec), b.numel, world) * world;
    at::Tensor grad = at::zeros({padded}, b.grad_data.options());
    grad.slice(0, 0, b.numel).copy_(b.grad_data);
    b.grad_data = grad;
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      b.params[i].mutable_grad() = at::Tensor();
      if (b.keeps_main_grad())
        b.main_grads[i] = grad.slice(0, b.offsets[i], b.offsets[i] + b.params[i].numel())
                              .view(b.params[i].sizes());
    }
    attach_grads(b, /*zero=*/false);
    b.param_data = at::zeros({padded}, b.params[0].options().requires_grad(false));
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      auto& p = b.params[i];
      at::Tensor view = b.param_data.slice(0, b.offsets[i], b.offsets[i] + p.numel());
      view.copy_(p.detach().reshape(-1));
      p.set_data(view.view(p.sizes()));
    }
    b.shard = at::zeros({padded / world}, b.grad_data.options().dtype(at::kFloat));
    b.state.clear();
  }
}

std::pair<std::int64_t, std::int64_t> GradReducer::chunk_range(const GradBucket& b,
                                                               bool sharded) const {
  if (!sharded) return {0, b.numel};
  MAPP_CHECK(zero_, "GradReducer: ZeRO-1 pieces need enable_distributed_optimizer() first");
  const std::int64_t chunk = b.param_data.numel() / torch_ext::group_size(b.group);
  const std::int64_t lo = torch_ext::group_rank(b.group) * chunk;
  return {lo, lo + chunk};
}

std::vector<GradReducer::Piece> GradReducer::pieces(bool sharded) const {
  std::vector<Piece> out;
  for (const auto& b : buckets_) {
    const auto [s_lo, s_hi] = chunk_range(b, sharded);
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      const std::int64_t off = b.offsets[i];
      const std::int64_t lo = std::max(off, s_lo), hi = std::min(off + b.params[i].numel(), s_hi);
      if (lo < hi)
        out.push_back({b.index, static_cast<int>(i), lo, hi, lo - s_lo, lo - off});
    }
  }
  return out;
}

namespace {
// The elements of piece `pc` in a parameter's flat storage (its values).
at::Tensor piece_values(const GradBucket& b, const GradReducer::Piece& pc, bool sharded) {
  if (sharded) return b.param_data.slice(0, pc.lo, pc.hi);
  return b.params[pc.slot].detach().reshape(-1).slice(0, pc.param_lo,
                                                      pc.param_lo + pc.hi - pc.lo);
}
}  // namespace

std::vector<at::Tensor> GradReducer::main_params(bool sharded) const {
  MAPP_CHECK(!sharded || zero_, "main_params(sharded=True) needs ZeRO-1 buckets "
             "(enable_distributed_optimizer first)");
  std::vector<at::Tensor> out;
  for (const Piece& pc : pieces(sharded))
    out.push_back(piece_values(buckets_[pc.bucket], pc, sharded).detach().to(at::kFloat).clone());
  return out;
}

std::vector<at::Tensor> GradReducer::main_grads(bool sharded) const {
  std::vector<at::Tensor> out;
  for (const Piece& pc : pieces(sharded)) {
    const GradBucket& b = buckets_[pc.bucket];
    MAPP_CHECK(b.grad_data.scalar_type() == at::kFloat, "the optimizer keeps float32 main "
               "gradients, but a bucket holds ", b.grad_data.scalar_type(), " gradients: wrap "
               "the model with DistributedDataParallel(..., grad_reduce_in_fp32=True)");
    out.push_back(sharded ? b.shard.slice(0, pc.shard_lo, pc.shard_lo + pc.hi - pc.lo)
                          : b.grad_data.slice(0, pc.lo, pc.hi));
  }
  return out;
}

void GradReducer::write_back(const std::vector<at::Tensor>& mains, bool sharded) {
  const std::vector<Piece> pcs = pieces(sharded);
  MAPP_CHECK(mains.size() == pcs.size(), "write_back: ", mains.size(), " main tensors for ",
             pcs.size(), " pieces");
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < pcs.size(); ++i)
    piece_values(buckets_[pcs[i].bucket], pcs[i], sharded).copy_(mains[i]);
}

void GradReducer::all_gather_params() {
  MAPP_CHECK(zero_, "all_gather_params needs ZeRO-1 buckets (a DistributedOptimizer)");
  at::NoGradGuard no_grad;
  finish_param_sync();
  for (auto& b : buckets_) {
    const auto [lo, hi] = chunk_range(b, true);
    b.param_data.copy_(torch_ext::all_gather(b.param_data.slice(0, lo, hi), 0, b.group));
  }
}

void GradReducer::start_param_sync() {
  MAPP_CHECK(zero_, "start_param_sync needs ZeRO-1 buckets (a DistributedOptimizer)");
  finish_param_sync();
  for (auto& b : buckets_)
    if (torch_ext::group_size(b.group) > 1)
      b.gather = torch_ext::param_all_gather_async(b.param_data, b.group);
  gathers_pending_ = std::any_of(buckets_.begin(), buckets_.end(),
                                 [](const GradBucket& b) { return bool(b.gather); });
}

void GradReducer::finish_param_sync(const std::optional<std::vector<int>>& which) {
  if (!gathers_pending_) return;
  auto wait = [](GradBucket& b) {
    if (!b.gather) return;
    c10::intrusive_ptr<torch_ext::CommWork> work = std::move(b.gather);
    b.gather.reset();
    trace::Scope scope("param_gather_wait", trace::Category::kCollective);
    scope.event().lane = trace::kMainLane;
    work->wait();
  };
  if (which) {
    for (int i : *which) {
      MAPP_CHECK(i >= 0 && i < static_cast<int>(buckets_.size()), "finish_param_sync: bucket ", i,
                 " out of range (", buckets_.size(), " buckets)");
      wait(buckets_[i]);
    }
  } else {
    for (auto& b : buckets_) wait(b);
  }
  gathers_pending_ = std::any_of(buckets_.begin(), buckets_.end(),
                                 [](const GradBucket& b) { return bool(b.gather); });
}

std::map<std::string, at::Tensor> GradReducer::codec_state() {
  std::map<std::string, at::Tensor> out;
  for (auto& b : buckets_)
    for (auto& [spec, tensors] : b.state)
      for (std::size_t i = 0; i < tensors.size(); ++i)
        out["b" + std::to_string(b.index) + "/" + spec + "/" + std::to_string(i)] = tensors[i];
  return out;
}

void GradReducer::load_codec_state(const std::map<std::string, at::Tensor>& tensors,
                                   int synchronized_steps) {
  at::NoGradGuard no_grad;
  sync_steps_ = synchronized_steps;
  for (const auto& [key, t] : tensors) {
    const auto a = key.find('/'), c = key.rfind('/');
    MAPP_CHECK(key.size() > 1 && key[0] == 'b' && a != std::string::npos && c > a,
               "DistributedDataParallel: codec state key '", key,
               "' is not of the form b<bucket>/<spec>/<i>");
    const int bucket = std::stoi(key.substr(1, a - 1));
    MAPP_CHECK(bucket >= 0 && bucket < static_cast<int>(buckets_.size()),
               "DistributedDataParallel: codec state for bucket ", bucket, " but the model has ",
               buckets_.size(), " buckets (a different model or bucket size)");
    auto& state = codec_state_of(buckets_[bucket], key.substr(a + 1, c - a - 1));
    const std::size_t i = std::stoul(key.substr(c + 1));
    MAPP_CHECK(i < state.size() && state[i].sizes() == t.sizes(),
               "DistributedDataParallel: codec state '", key, "' does not fit this model");
    state[i].copy_(t);
  }
}

// ---- DistributedDataParallel (the C++ front-end) -----------------------------------------

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 const dist::ParallelState& state,
                                                 DDPOptions options)
    : module_(std::move(module)) {
  MAPP_CHECK(module_ != nullptr, "DistributedDataParallel: null module");
  MAPP_CHECK(options.bucket_size_mb > 0, "DistributedDataParallel: bucket_size_mb must be ",
             "positive, got ", options.bucket_size_mb);
  codec::Spec::parse(options.compression);  // a clear error for an unknown codec, here
  const std::string group = state.data_context_group();
  at::NoGradGuard no_grad;
  std::ostringstream desc;
  for (const auto& p : module_->parameters()) {
    MAPP_CHECK(p.scalar_type() == at::kFloat,
               "DistributedDataParallel (C++): parameters must be float32, got ", p.scalar_type(),
               "; mixed precision from C++ is not available yet");
    desc << p.sizes() << p.requires_grad() << ';';
  }
  if (torch_ext::group_size(group) > 1) {
    // Every replica must hold the same model (else the buckets would not match).
    const std::string d = desc.str();
    const at::Tensor mine = at::full({1}, static_cast<std::int64_t>(crc32(d.data(), d.size())),
                                     at::kLong);
    const at::Tensor all = torch_ext::all_gather(mine, 0, group);
    MAPP_CHECK(all.eq(all[0]).all().item<bool>(),
               "DistributedDataParallel: the model differs across data-parallel ranks "
               "(parameter shapes hash to different values: ",
               all, "); every rank of the group must build the same model");
    if (options.broadcast_parameters) {
      const bool root = torch_ext::group_rank(group) == 0;
      for (auto& p : module_->parameters()) {  // rank 0's values: x + 0 + ... = x
        at::Tensor d = p.detach();
        if (!root) d.zero_();
        torch_ext::all_reduce_sum_(d, group);
      }
    }
  }
  std::vector<ReducerParam> params;
  for (const auto& p : module_->parameters()) {
    if (!p.requires_grad()) continue;
    const nn::ParamAttrs a = nn::param_attrs(p);
    // Under tensor parallelism, parameters replicated over the tensor group
    // are reduced exactly (a lossy codec would quantize them differently on
    // each tensor rank, and the replicas would drift apart).
    params.push_back({p, state.tp_size() > 1 && !a.tensor_parallel, false, a.shared_embedding});
  }
  ReducerOptions ro;
  ro.bucket_bytes = static_cast<std::int64_t>(options.bucket_size_mb * 1024 * 1024);
  ro.compression = options.compression;
  ro.compression_start_iter = options.compression_start_iter;
  ro.overlap_grad_reduce = options.overlap_grad_reduce;
  ro.gradient_accumulation_fusion = options.gradient_accumulation_fusion;
  ro.group = group;
  reducer_ = std::make_unique<GradReducer>(std::move(params), std::move(ro));
  // C++ trainers and pipelines finish once per step (finish_grad_sync).
  reducer_->set_finish_at_backward_end(false);
}

void DistributedDataParallel::zero_grad_buffer() {
  reducer_->zero_grad_buffer();
  reducer_->prepare_forward();  // .grad views again where they were reset; readiness reset
}

// ---- LossScaler ------------------------------------------------------------------------

LossScaler::LossScaler(double scale) : scale_(scale) {
  MAPP_CHECK(scale > 0, "loss scale must be positive, got ", scale);
  options_.initial_scale = scale;
}

LossScaler::LossScaler(const LossScalerOptions& o)
    : options_(o), dynamic_(true), scale_(o.initial_scale), hysteresis_tracker_(o.hysteresis) {
  MAPP_CHECK(o.initial_scale > 0, "loss scale must be positive, got ", o.initial_scale);
  MAPP_CHECK(o.min_scale > 0 && o.min_scale <= o.initial_scale,
             "min loss scale must be in (0, initial scale ", o.initial_scale, "], got ",
             o.min_scale);
  MAPP_CHECK(o.growth_factor > 1 && o.backoff_factor > 0 && o.backoff_factor < 1,
             "growth factor must exceed 1 and backoff factor lie in (0, 1)");
  MAPP_CHECK(o.growth_interval >= 1 && o.hysteresis >= 1, "loss-scale window (",
             o.growth_interval, ") and hysteresis (", o.hysteresis, ") must be >= 1");
}

void LossScaler::update(bool found_inf) {
  if (!dynamic_) return;
  if (found_inf) {
    growth_tracker_ = 0;
    if (--hysteresis_tracker_ <= 0)
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
  } else if (++growth_tracker_ == options_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = options_.hysteresis;
    scale_ *= options_.growth_factor;
  }
}

void LossScaler::load(double scale, int growth_tracker, int hysteresis_tracker) {
  MAPP_CHECK(scale > 0, "loss scale must be positive, got ", scale, " (a corrupt checkpoint?)");
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  hysteresis_tracker_ = hysteresis_tracker;
}

// ---- AdamW ---------------------------------------------------------------------------

at::Tensor AdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    MAPP_CHECK(!o.amsgrad(), "mapp::AdamW: amsgrad is not supported");
    const double lr = o.lr(), wd = o.weight_decay(), eps = o.eps();
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& grad = p.grad();
      auto it = state_.find(p.unsafeGetTensorImpl());
      if (it == state_.end()) {
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        st->step(0);
        st->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        st->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        it = state_.emplace(p.unsafeGetTensorImpl(), std::move(st)).first;
      }
      auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
      st.step(st.step() + 1);
      if (wd != 0) p.mul_(1 - lr * wd);
      st.exp_avg().lerp_(grad, 1 - beta1);
      st.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
      const double step = static_cast<double>(st.step());
      const double step_size = lr / (1 - std::pow(beta1, step));
      const double bias_correction2_sqrt = std::pow(1 - std::pow(beta2, step), 0.5);
      const at::Tensor denom = (st.exp_avg_sq().sqrt() / bias_correction2_sqrt).add_(eps);
      p.addcdiv_(st.exp_avg(), denom, -step_size);
    }
  }
  return loss;
}

// ---- DistributedOptimizer -----------------------------------------------------------

DistributedOptimizer::DistributedOptimizer(DistributedDataParallel& ddp,
                                           const std::vector<ParamGroup>& groups,
                                           const dist::ParallelState& state)
    : DistributedOptimizer(std::vector<DistributedDataParallel*>{&ddp}, groups, state) {}

DistributedOptimizer::DistributedOptimizer(const std::vector<DistributedDataParallel*>& chunks,
                                           const std::vector<ParamGroup>& groups,
                                           const dist::ParallelState& state)
    : ddps_(chunks), state_(state) {
  MAPP_CHECK(!groups.empty(), "DistributedOptimizer: no parameter groups");
  MAPP_CHECK(!ddps_.empty(), "DistributedOptimizer: no model chunks");
  for (DistributedDataParallel* ddp : ddps_) ddp->enable_distributed_optimizer();
  std::unordered_map<const c10::TensorImpl*, std::size_t> group_of;
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params) group_of[p.unsafeGetTensorImpl()] = g;
  std::vector<std::vector<at::Tensor>> by_group(groups.size());
  for (DistributedDataParallel* ddp : ddps_) {
    GradReducer& r = ddp->reducer();
    const std::vector<GradReducer::Piece> pcs = r.pieces(/*sharded=*/true);
    const std::vector<at::Tensor> mains = r.main_params(true), grads = r.main_grads(true);
    for (std::size_t i = 0; i < pcs.size(); ++i) {
      const auto& pc = pcs[i];
      const at::Tensor& param = ddp->buckets()[pc.bucket].params[pc.slot];
      at::Tensor main = mains[i];
      main.set_requires_grad(true);
      const auto it = group_of.find(param.unsafeGetTensorImpl());
      MAPP_CHECK(it != group_of.end(), "DistributedOptimizer: a parameter of the model is in no ",
                 "parameter group (every parameter must be in exactly one)");
      pieces_.push_back({ddp, param, pc.param_lo, pc.param_lo + pc.hi - pc.lo, main, grads[i]});
      by_group[it->second].push_back(main);
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> inner;
  for (std::size_t g = 0; g < groups.size(); ++g)
    inner.emplace_back(by_group[g],
                       std::make_unique<torch::optim::AdamWOptions>(groups[g].options));
  optimizer_ = std::make_unique<AdamW>(std::move(inner));
}

void DistributedOptimizer::zero_grad() {
  for (DistributedDataParallel* ddp : ddps_) ddp->zero_grad_buffer();
  for (auto& pc : pieces_) pc.main.mutable_grad() = at::Tensor();
  finished_ = false;
}

double DistributedOptimizer::clip_grad_norm(double max_norm) {
  at::NoGradGuard no_grad;
  Pairs pairs;
  for (auto& pc : pieces_) {
    if (!finished_)  // the averaged fp32 gradient of the piece: a view into its shard
      pc.main.mutable_grad() = pc.grad;
    pairs.emplace_back(pc.param, pc.main.grad());
  }
  if (!finished_) {
    for (DistributedDataParallel* ddp : ddps_) ddp->finish_grad_sync();
    add_partial_sums(pairs, state_);  // element-wise: a shard sums like the whole
    finished_ = true;
  }
  // The shards partition each parameter over the data group: summed there too.
  return clip_by_global_norm(pairs, state_, {ddps_.front()->group(), state_.model_group()},
                             max_norm);
}

void DistributedOptimizer::step() {
  if (!finished_) clip_grad_norm(0.0);
  optimizer_->step();
  std::map<DistributedDataParallel*, std::vector<at::Tensor>> mains;
  for (auto& pc : pieces_) mains[pc.ddp].push_back(pc.main);
  for (DistributedDataParallel* ddp : ddps_) {
    ddp->reducer().write_back(mains[ddp], /*sharded=*/true);
    ddp->reducer().all_gather_params();
  }
  finished_ = false;
}

void DistributedOptimizer::set_lr(double lr) {
  for (auto& g : optimizer_->param_groups())
    static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

std::vector<Shard> DistributedOptimizer::shards() const {
  std::vector<Shard> out;
  for (const auto& pc : pieces_)
    out.push_back({pc.param, pc.param_lo, pc.param_hi, pc.main});
  return out;
}

}  // namespace mapp
