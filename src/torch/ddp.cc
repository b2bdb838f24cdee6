// mapp::DistributedDataParallel and mapp::DistributedOptimizer
// (include/mapp/torch/ddp.h): the Python distributed/data_parallel.py / optimizer/optimizer.py
// mechanisms, bucket for bucket.
#include "mapp/torch/ddp.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
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
#include "mapp/torch/compressed.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"

namespace mapp {
namespace {

// The post-accumulate-grad hook of one parameter: tells the DDP (if it still
// exists) that the parameter's gradient for this backward is complete.
class ReadyHook : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(std::weak_ptr<bool> alive, std::function<void()> ready)
      : alive_(std::move(alive)), ready_(std::move(ready)) {}
  void operator()(const torch::autograd::Variable& param) override {
    // A weight gradient put aside by a zero-bubble BI is not ready: its W is.
    if (!alive_.expired() && !nn::is_deferred(param)) ready_();
  }

 private:
  std::weak_ptr<bool> alive_;
  std::function<void()> ready_;
};

std::uint32_t fnv1a(const std::string& s) {
  std::uint32_t h = 2166136261u;
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return h;
}

// Sums `grads` over `group` in one flat buffer (element-wise, so the same as
// one call per tensor; one collective instead of many).
void flat_all_reduce(const std::vector<at::Tensor>& grads, const std::string& group) {
  if (grads.empty() || torch_ext::group_size(group) == 1) return;
  std::vector<at::Tensor> flat_parts;
  for (const auto& g : grads) flat_parts.push_back(g.reshape(-1));
  at::Tensor flat = at::cat(flat_parts);
  torch_ext::all_reduce_sum_(flat, group);
  std::int64_t off = 0;
  for (const auto& g : grads) {
    g.view(-1).copy_(flat.slice(0, off, off + g.numel()));
    off += g.numel();
  }
}

using Pairs = std::vector<std::pair<at::Tensor, at::Tensor>>;  // (param, its gradient or shard)

// Parameters replicated over the tensor group but fed a sequence shard hold
// partial sums: added over the tensor group.
void add_sequence_parallel_sums(const Pairs& pairs, const dist::ParallelState& st) {
  if (st.tp_size() == 1) return;
  std::vector<at::Tensor> sp;
  for (const auto& [p, g] : pairs)
    if (nn::param_attrs(p).sequence_parallel) sp.push_back(g);
  flat_all_reduce(sp, st.tensor_group());
}

// Tied word embeddings on the first and last pipeline stage: their gradients
// (or ZeRO-1 shards: the embedding has its own bucket, so the same slice on
// both stages) are summed over the embedding group.
void add_embedding_sums(const Pairs& pairs, const dist::ParallelState& st) {
  if (st.pp_size() == 1 || st.embedding_group().empty()) return;
  std::vector<at::Tensor> shared;
  for (const auto& [p, g] : pairs)
    if (nn::param_attrs(p).shared_embedding) shared.push_back(g);
  flat_all_reduce(shared, st.embedding_group());
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

// [lo, hi) of ZeRO-1 bucket b (padded to equal chunks) that this rank owns.
std::pair<std::int64_t, std::int64_t> chunk_range(const GradBucket& b) {
  const std::int64_t chunk = b.param_data.numel() / torch_ext::group_size(b.group);
  const std::int64_t lo = torch_ext::group_rank(b.group) * chunk;
  return {lo, lo + chunk};
}

}  // namespace

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
  add_sequence_parallel_sums(pairs, state);
  add_embedding_sums(pairs, state);
  return clip_by_global_norm(pairs, state, {state.model_group()}, max_norm);
}

double finish_gradients(DistributedDataParallel& ddp, const dist::ParallelState& state,
                        double max_norm) {
  return finish_gradients(std::vector<DistributedDataParallel*>{&ddp}, state, max_norm);
}

// ---- DistributedDataParallel --------------------------------------------------------

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 const dist::ParallelState& state,
                                                 DDPOptions options)
    : module_(std::move(module)),
      options_(std::move(options)),
      group_(state.data_context_group()),
      alive_(std::make_shared<bool>(true)) {
  MAPP_CHECK(module_ != nullptr, "DistributedDataParallel: null module");
  MAPP_CHECK(options_.bucket_size_mb > 0, "DistributedDataParallel: bucket_size_mb must be ",
             "positive, got ", options_.bucket_size_mb);
  codec::Spec::parse(options_.compression);  // a clear error for an unknown codec, here
  exact_replicated_ = state.tp_size() > 1;
  at::NoGradGuard no_grad;
  std::ostringstream desc;
  for (const auto& p : module_->parameters()) {
    MAPP_CHECK(p.scalar_type() == at::kFloat,
               "DistributedDataParallel (C++): parameters must be float32, got ", p.scalar_type(),
               "; mixed precision from C++ is not available yet");
    desc << p.sizes() << p.requires_grad() << ';';
  }
  if (torch_ext::group_size(group_) > 1) {
    // Every replica must hold the same model (else the buckets would not match).
    const at::Tensor mine = at::full({1}, static_cast<std::int64_t>(fnv1a(desc.str())), at::kLong);
    const at::Tensor all = torch_ext::all_gather(mine, 0, group_);
    MAPP_CHECK(all.eq(all[0]).all().item<bool>(),
               "DistributedDataParallel: the model differs across data-parallel ranks "
               "(parameter shapes hash to different values: ",
               all, "); every rank of the group must build the same model");
    if (options_.broadcast_parameters) {
      const bool root = torch_ext::group_rank(group_) == 0;
      for (auto& p : module_->parameters()) {  // rank 0's values: x + 0 + ... = x
        at::Tensor d = p.detach();
        if (!root) d.zero_();
        torch_ext::all_reduce_sum_(d, group_);
      }
    }
  }
  build_buckets();
  std::weak_ptr<bool> alive = alive_;
  for (std::size_t i = 0; i < buckets_.size(); ++i)
    for (const auto& p : buckets_[i].params)
      torch::autograd::impl::set_post_acc_grad_hooks(
          p, std::make_unique<ReadyHook>(alive, [this, i] { on_grad_ready(i); }));
}

DistributedDataParallel::~DistributedDataParallel() {
  alive_.reset();  // hooks that fire later do nothing
  for (auto& b : buckets_)
    if (b.handle) {
      try {
        b.handle->wait();
      } catch (...) {  // a destructor must not throw; the error was the step's
      }
    }
}

void DistributedDataParallel::build_buckets() {
  std::vector<at::Tensor> params;
  for (const auto& p : module_->parameters())
    if (p.requires_grad()) params.push_back(p);
  std::reverse(params.begin(), params.end());  // backward produces the last layers' first
  const std::int64_t limit = static_cast<std::int64_t>(options_.bucket_size_mb * 1024 * 1024);
  // Open buckets by key (exact), in order of first appearance (as Python's dict).
  struct Open {
    bool exact;
    std::vector<at::Tensor> params;
    std::int64_t bytes = 0;
  };
  std::vector<Open> open;
  for (const auto& p : params) {
    const nn::ParamAttrs attrs = nn::param_attrs(p);
    if (attrs.shared_embedding) {  // own bucket: the same ZeRO-1 slice on both stages
      add_bucket({p}, false);
      continue;
    }
    const bool exact = exact_replicated_ && !attrs.tensor_parallel;
    auto it =
        std::find_if(open.begin(), open.end(), [&](const Open& o) { return o.exact == exact; });
    if (it == open.end()) it = open.insert(open.end(), Open{exact, {}, 0});
    it->params.push_back(p);
    it->bytes += p.numel() * p.element_size();
    if (it->bytes >= limit) {
      add_bucket(std::move(it->params), exact);
      it->params.clear();
      it->bytes = 0;
    }
  }
  for (auto& o : open)
    if (!o.params.empty()) add_bucket(std::move(o.params), o.exact);
}

void DistributedDataParallel::add_bucket(std::vector<at::Tensor> params, bool exact) {
  GradBucket b;
  b.index = static_cast<int>(buckets_.size());
  for (const auto& p : params) {
    b.offsets.push_back(b.numel);
    if (p.dim() == 2) b.layout.insert(b.layout.end(), {b.numel, p.size(0), p.size(1)});
    b.numel += p.numel();
  }
  b.params = std::move(params);
  b.grad_data = at::zeros({b.numel}, b.params[0].options().requires_grad(false));
  b.exact = exact;
  b.group = group_;
  buckets_.push_back(std::move(b));
  attach_grads(buckets_.back());
}

void DistributedDataParallel::attach_grads(GradBucket& b) {
  for (std::size_t i = 0; i < b.params.size(); ++i) {
    auto& p = b.params[i];
    const at::Tensor view =
        b.grad_data.slice(0, b.offsets[i], b.offsets[i] + p.numel()).view(p.sizes());
    at::Tensor& grad = p.mutable_grad();
    if (grad.defined() && grad.data_ptr() != view.data_ptr())
      view.copy_(grad);  // the user replaced .grad: adopt its values
    grad = view;
  }
}

std::string DistributedDataParallel::spec_for(const GradBucket& b) const {
  if (b.exact || options_.compression == "none" || sync_steps_ < options_.compression_start_iter)
    return "none";
  return options_.compression;
}

std::vector<at::Tensor>& DistributedDataParallel::codec_state_of(GradBucket& b,
                                                                 const std::string& spec) {
  auto it = b.state.find(spec);
  if (it == b.state.end())
    it = b.state
             .emplace(spec, torch_ext::codec_state(codec::Spec::parse(spec), b.grad_data.numel(),
                                                   torch_ext::group_size(b.group), b.layout,
                                                   b.index, b.grad_data.options()))
             .first;
  return it->second;
}

void DistributedDataParallel::on_grad_ready(std::size_t bucket) {
  if (!sync_) return;
  started_ = true;
  ++buckets_[bucket].ready;
  if (!options_.overlap_grad_reduce) return;
  // Strictly in order, so every rank issues the same sequence of collectives.
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].ready == static_cast<int>(buckets_[next_bucket_].params.size()))
    launch(buckets_[next_bucket_++]);
}

void DistributedDataParallel::launch(GradBucket& b) {
  const std::string spec = spec_for(b);
  std::vector<at::Tensor> state = codec_state_of(b, spec);
  torch_ext::CompressedOptions opts{codec::Spec::parse(spec), b.layout, /*average=*/true, b.group};
  b.handle = zero_ ? torch_ext::compressed_reduce_scatter_async(b.grad_data, b.shard,
                                                                std::move(opts), std::move(state))
                   : torch_ext::compressed_all_reduce_async(b.grad_data, std::move(opts),
                                                            std::move(state));
}

void DistributedDataParallel::finish_grad_sync() {
  if (!started_) return;  // no synchronized backward since the last finish
  while (next_bucket_ < buckets_.size()) launch(buckets_[next_bucket_++]);
  torch_ext::CommStats step;
  for (auto& b : buckets_) {
    if (!b.handle) continue;
    b.stats = b.handle->wait();
    b.handle.reset();
    step.raw_bytes += b.stats.raw_bytes;
    step.sent_bytes += b.stats.sent_bytes;
  }
  for (auto& b : buckets_) b.ready = 0;
  step_stats_ = step;
  next_bucket_ = 0;
  started_ = false;
  ++sync_steps_;
}

void DistributedDataParallel::zero_grad_buffer() {
  MAPP_CHECK(!started_, "DistributedDataParallel: zero_grad_buffer during a step whose ",
             "reduction is not finished (call finish_grad_sync first)");
  for (auto& b : buckets_) {
    b.grad_data.zero_();
    attach_grads(b);  // in case .grad was reset to undefined
  }
}

void DistributedDataParallel::enable_distributed_optimizer() {
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
    for (auto& p : b.params) p.mutable_grad() = at::Tensor();
    attach_grads(b);
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

std::map<std::string, at::Tensor> DistributedDataParallel::codec_state() {
  std::map<std::string, at::Tensor> out;
  for (auto& b : buckets_)
    for (auto& [spec, tensors] : b.state)
      for (std::size_t i = 0; i < tensors.size(); ++i)
        out["b" + std::to_string(b.index) + "/" + spec + "/" + std::to_string(i)] = tensors[i];
  return out;
}

void DistributedDataParallel::load_codec_state(const std::map<std::string, at::Tensor>& tensors,
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
  for (auto& b : all_buckets()) {
    const auto [s_lo, s_hi] = chunk_range(*b);
    for (std::size_t i = 0; i < b->params.size(); ++i) {
      const std::int64_t off = b->offsets[i];
      const std::int64_t lo = std::max(off, s_lo), hi = std::min(off + b->params[i].numel(), s_hi);
      if (lo >= hi) continue;
      at::Tensor main = b->param_data.slice(0, lo, hi).detach().to(at::kFloat).clone();
      main.set_requires_grad(true);
      const auto it = group_of.find(b->params[i].unsafeGetTensorImpl());
      MAPP_CHECK(it != group_of.end(), "DistributedOptimizer: a parameter of the model is in no ",
                 "parameter group (every parameter must be in exactly one)");
      pieces_.push_back({b, b->params[i], lo, hi, lo - s_lo, lo - off, main});
      by_group[it->second].push_back(main);
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> inner;
  for (std::size_t g = 0; g < groups.size(); ++g)
    inner.emplace_back(by_group[g],
                       std::make_unique<torch::optim::AdamWOptions>(groups[g].options));
  optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(inner));
}

std::vector<GradBucket*> DistributedOptimizer::all_buckets() {
  std::vector<GradBucket*> out;
  for (DistributedDataParallel* ddp : ddps_)
    for (auto& b : ddp->buckets()) out.push_back(&b);
  return out;
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
      pc.main.mutable_grad() = pc.bucket->shard.slice(0, pc.shard_lo, pc.shard_lo + pc.hi - pc.lo);
    pairs.emplace_back(pc.param, pc.main.grad());
  }
  if (!finished_) {
    for (DistributedDataParallel* ddp : ddps_) ddp->finish_grad_sync();
    add_sequence_parallel_sums(pairs, state_);  // element-wise: a shard sums like the whole
    add_embedding_sums(pairs, state_);
    finished_ = true;
  }
  // The shards partition each parameter over the data group: summed there too.
  return clip_by_global_norm(pairs, state_, {ddps_.front()->group(), state_.model_group()},
                             max_norm);
}

void DistributedOptimizer::step() {
  if (!finished_) clip_grad_norm(0.0);
  optimizer_->step();
  at::NoGradGuard no_grad;
  for (auto& pc : pieces_) pc.bucket->param_data.slice(0, pc.lo, pc.hi).copy_(pc.main);
  for (GradBucket* b : all_buckets()) {
    const auto [lo, hi] = chunk_range(*b);
    b->param_data.copy_(torch_ext::all_gather(b->param_data.slice(0, lo, hi), 0, b->group));
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
    out.push_back({pc.param, pc.param_lo, pc.param_lo + pc.hi - pc.lo, pc.main});
  return out;
}

}  // namespace mapp
