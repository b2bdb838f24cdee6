// mapp::forward_backward: the pipeline executor for C++ trainers
// (include/mapp/torch/pipeline.h), action for action the Python executor
// (python/megatronapp/pipeline/executor.py).
#include "mapp/torch/pipeline.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "c10d_util.h"
#include "mapp/common/check.h"
#include "mapp/torch/faults.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"
#include "mapp/trace/tracer.h"

namespace mapp {
namespace {

using pipeline::Action;
using pipeline::ActionType;
using Key = std::tuple<int, int, int>;  // (kind 0 activation / 1 gradient, microbatch, vstage)

const char* trace_name(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return "forward";
    case ActionType::kBackward:
      return "backward";
    case ActionType::kBackwardInput:
      return "backward-input";
    default:
      return "backward-weight";
  }
}

// Non-blocking sends and receives to the pipeline peers, matched by tag.
class P2P {
 public:
  P2P(const dist::ParallelState& st, const pipeline::Schedule& s, const PipelineOptions& o,
      PipelineResult& result)
      : group_(st.pipeline_group()),
        stage_(st.pp_rank()),
        m_(s.microbatches),
        shape_(o.tensor_shape),
        dtype_(o.dtype),
        device_(o.device),
        result_(result) {
    if (st.pp_size() > 1) pg_ = torch_ext::internal::resolve(group_);
    // Global ranks of the stages (trace events name them as Python's do).
    Coord c = st.grid().coord(st.rank());
    for (int s2 = 0; s2 < st.pp_size(); ++s2) {
      c.pp = s2;
      global_.push_back(st.grid().rank(c));
    }
  }

  // "p2p:<src>-><dst>" of global ranks: megatronapp.trace pairs each send
  // with the receive wait that consumed it by this group and the tag.
  std::string link(int from_stage, int to_stage) const {
    return "p2p:" + std::to_string(global_[from_stage]) + "->" + std::to_string(global_[to_stage]);
  }

  int tag(const Key& k) const {
    const auto [kind, mb, vs] = k;
    return (vs * m_ + mb) * 2 + kind;
  }

  void post_recv(const Key& key, int peer) {
    MAPP_CHECK(!shape_.empty(),
               "forward_backward: PipelineOptions.tensor_shape is required with more than one "
               "pipeline stage (the shape of the activations between stages, e.g. {seq_length, "
               "micro_batch_size, hidden_size})");
    Pending r;
    r.tensors = {at::empty(shape_, at::TensorOptions().dtype(dtype_).device(device_))};
    r.peer = peer;
    r.work = pg_->recv(r.tensors, peer, tag(key));
    recvs_.emplace(key, std::move(r));
  }

  at::Tensor wait_recv(const Key& key) {
    auto it = recvs_.find(key);
    MAPP_CHECK_STATE(it != recvs_.end(), "forward_backward: an input of microbatch ",
                     std::get<1>(key), " was never received (the schedule posts no RECV for it)");
    Pending r = std::move(it->second);
    recvs_.erase(it);
    const auto t0 = std::chrono::steady_clock::now();
    {
      trace::Scope scope("recv_wait", trace::Category::kP2P);
      scope.event().microbatch = std::get<1>(key);
      scope.event().peer = global_[r.peer];
      scope.event().seq = tag(key);
      scope.event().bytes = static_cast<std::int64_t>(r.tensors[0].nbytes());
      scope.event().set_group(link(r.peer, stage_));
      wait(r, "receive");
    }
    result_.recv_wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (std::get<0>(key) == 1) {
      // The gradient of this microbatch came back: the next stage ran its
      // forward, so our activation send to it completed; release it now.
      auto s = sends_.find({0, std::get<1>(key), std::get<2>(key) + 1});
      if (s != sends_.end()) {
        wait(s->second, "send");
        sends_.erase(s);
      }
    }
    return r.tensors[0];
  }

  void send(const Key& key, const at::Tensor& tensor, int peer) {
    at::Tensor t = tensor.detach().contiguous();
    if (t.sizes() != at::IntArrayRef(shape_) || t.scalar_type() != dtype_)
      MAPP_CHECK(false, "forward_backward: a stage produced a tensor of shape ", t.sizes(),
                 " and dtype ", t.scalar_type(), " but tensor_shape=", at::IntArrayRef(shape_),
                 ", dtype=", dtype_, " were given; every stage boundary must match them");
    Pending s;
    s.tensors = {t};
    s.peer = peer;
    {
      trace::Scope scope("send", trace::Category::kP2P);
      scope.event().lane = trace::kP2PLane;
      scope.event().microbatch = std::get<1>(key);
      scope.event().peer = global_[peer];
      scope.event().seq = tag(key);
      scope.event().bytes = static_cast<std::int64_t>(t.nbytes());
      scope.event().set_group(link(stage_, peer));
      s.work = pg_->send(s.tensors, peer, tag(key));
    }
    result_.sent_bytes += static_cast<std::int64_t>(t.nbytes());
    sends_.emplace(key, std::move(s));
  }

  void finish() {
    for (auto& [key, s] : sends_) wait(s, "send");  // exactly once each (Gloo)
    sends_.clear();
    MAPP_CHECK_STATE(recvs_.empty(), "forward_backward: ", recvs_.size(),
                     " receives were posted but never used (a malformed schedule)");
  }

 private:
  struct Pending {
    std::vector<at::Tensor> tensors;
    c10::intrusive_ptr<c10d::Work> work;
    int peer = -1;
  };

  void wait(Pending& p, const char* what) {
    try {
      p.work->wait(torch_ext::internal::collective_timeout());
    } catch (const std::exception& e) {
      MAPP_FAIL_BACKEND("forward_backward: pipeline ", what, " with stage ", p.peer, " on group '",
                        group_, "' failed (stage ", stage_,
                        "; MAPP_COLLECTIVE_TIMEOUT_S bounds the wait): ", e.what());
    }
  }

  std::string group_;
  int stage_, m_;
  std::vector<std::int64_t> shape_;
  at::ScalarType dtype_;
  at::Device device_;
  PipelineResult& result_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::vector<int> global_;  // stage -> global rank
  std::map<Key, Pending> recvs_, sends_;
};

// Indices of the actions during which a chunk's DDP synchronizes: its last
// B/BI (gradients that are not deferred) and its last B/W (matmul weights).
std::set<std::size_t> final_backwards(const std::vector<Action>& actions) {
  std::map<int, std::size_t> last_input, last_weight;
  std::map<int, std::set<ActionType>> kinds;
  for (std::size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) {
      last_input[a.chunk] = i;
      kinds[a.chunk].insert(a.type);
    }
    if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight)
      last_weight[a.chunk] = i;
  }
  for (const auto& [c, k] : kinds)
    MAPP_CHECK(k.size() == 1, "forward_backward: chunk ", c,
               " mixes full backwards (B) and split ones (BI/W) on one stage; use one kind "
               "per chunk");
  std::set<std::size_t> out;
  for (const auto& [c, i] : last_input) out.insert(i);
  for (const auto& [c, i] : last_weight) out.insert(i);
  return out;
}

}  // namespace

PipelineResult forward_backward(const pipeline::Schedule& schedule,
                                const std::vector<PipelineChunk>& chunks,
                                const std::function<at::Tensor(int)>& inputs,
                                const std::function<at::Tensor(const at::Tensor&, int)>& loss_fn,
                                const dist::ParallelState& st, const PipelineOptions& options) {
  const int p = schedule.stages, m = schedule.microbatches, v = schedule.chunks;
  MAPP_CHECK(p == st.pp_size(), "forward_backward: schedule '", schedule.name, "' has ", p,
             " stages but the pipeline-parallel size is ", st.pp_size());
  MAPP_CHECK(static_cast<int>(chunks.size()) == v, "forward_backward: schedule '", schedule.name,
             "' has ", v, " chunks per stage but ", chunks.size(), " model chunks were given");
  const int stage = st.pp_rank();
  MAPP_CHECK(schedule.placement == pipeline::Placement::kLoop, "forward_backward (C++ trainers): "
             "schedule '", schedule.name, "' places its chunks in a wave (zb-v), which only the "
             "Python executor (pretrain_gpt.py) runs so far; use 1f1b, interleaved, zero-bubble "
             "or dynamic here");
  MAPP_CHECK(p == 1 || schedule.has_communication(), "forward_backward: schedule '", schedule.name,
             "' has no sends or receives (pipeline::add_communication inserts them)");
  std::vector<Action> actions;
  for (const Action& a : schedule.actions.at(stage))
    if (!options.forward_only || a.type == ActionType::kForward ||
        a.type == ActionType::kSendActivation || a.type == ActionType::kRecvActivation)
      actions.push_back(a);

  PipelineResult result;
  const auto t_step = std::chrono::steady_clock::now();
  P2P p2p(st, schedule, options, result);
  const std::set<std::size_t> final =
      options.forward_only ? std::set<std::size_t>{} : final_backwards(actions);
  // (kind, microbatch, chunk) -> the peer stage its input comes from
  std::map<Key, int> recv_peer;
  for (const Action& a : actions)
    if (a.type == ActionType::kRecvActivation || a.type == ActionType::kRecvGrad)
      recv_peer[{a.type == ActionType::kRecvActivation ? 0 : 1, a.microbatch, a.chunk}] = a.peer;

  std::map<std::pair<int, int>, at::Tensor> input_of, output_of;  // (mb, chunk)
  std::map<std::pair<int, int>, nn::WeightGradStore> wstore;
  std::map<std::string, std::pair<double, int>> times;
  std::unique_ptr<at::NoGradGuard> no_grad;
  if (options.forward_only) no_grad = std::make_unique<at::NoGradGuard>();
  const int last_vs = p * v - 1;
  int live = 0;
  // MAPP_INJECT_SLOWDOWN naming this rank: its actions do `factor` x their work.
  std::optional<faults::Slowdown> slow = faults::injected_slowdown();
  if (slow && (slow->rank != st.rank() || slow->factor == 1.0)) slow.reset();
  // Synchronize only where the executor says (final backwards); restored after.
  for (const auto& c : chunks)
    if (c.ddp != nullptr && !options.forward_only) c.ddp->set_sync(false);

  for (std::size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    const int mb = a.microbatch, c = a.chunk, vs = c * p + stage;
    const std::pair<int, int> id{mb, c};
    switch (a.type) {
      case ActionType::kRecvActivation:
        p2p.post_recv({0, mb, vs}, a.peer);
        continue;
      case ActionType::kRecvGrad:
        p2p.post_recv({1, mb, vs}, a.peer);
        continue;
      case ActionType::kSendActivation:
        p2p.send({0, mb, vs + 1}, output_of.at(id), a.peer);
        if (options.forward_only) output_of.erase(id);
        continue;
      case ActionType::kSendGrad: {
        const at::Tensor x = input_of.at(id);
        MAPP_CHECK_STATE(x.grad().defined(), "forward_backward: no input gradient of microbatch ",
                         mb, " chunk ", c, " to send (did its backward run?)");
        p2p.send({1, mb, vs - 1}, x.grad(), a.peer);
        input_of.erase(id);
        continue;
      }
      default:
        break;
    }
    at::Tensor x, dy;
    if (a.type == ActionType::kForward) {
      if (vs == 0) {
        x = inputs(mb);
      } else {
        x = p2p.wait_recv({0, mb, vs});
        if (!options.forward_only) x.requires_grad_(true);
      }
    } else if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
               vs < last_vs) {
      dy = p2p.wait_recv({1, mb, vs});
    }
    trace::Scope scope(trace_name(a.type), trace::Category::kCompute);
    scope.event().microbatch = mb;
    scope.event().chunk = c;
    const auto t0 = std::chrono::steady_clock::now();
    // On CPU the device's busy time is this thread's CPU time (as Python's
    // trace scopes record it): waiting for a core does not count, so the
    // slow-rank detector compares work, not scheduling luck.
    const bool cpu_busy = options.device.is_cpu() && trace::global() != nullptr;
    const std::int64_t thread_t0 = slow || cpu_busy ? faults::thread_time_ns() : 0;
    DistributedDataParallel* ddp = chunks[c].ddp;
    if (ddp != nullptr && !options.forward_only) ddp->set_sync(final.count(i) > 0);
    const char* kind = pipeline::type_name(a.type);
    if (a.type == ActionType::kForward) {
      at::Tensor out = chunks[c].forward(x);
      if (vs == last_vs) {
        const at::Tensor loss = loss_fn(out, mb);
        result.losses.push_back(loss.detach());
        out = loss / m;
      }
      if (!(options.forward_only && vs == last_vs)) {
        input_of[id] = x;
        output_of[id] = out;
      }
      result.peak_activations = std::max(result.peak_activations, ++live);
    } else if (a.type == ActionType::kBackwardWeight) {
      auto it = wstore.find(id);
      MAPP_CHECK_STATE(it != wstore.end(), "forward_backward: W of microbatch ", mb, " chunk ", c,
                       " before its BI");
      nn::run_weight_grads(it->second);
      wstore.erase(it);
      --live;
    } else {
      const at::Tensor out = output_of.at(id);
      output_of.erase(id);
      const std::vector<at::Tensor> grad =
          vs == last_vs ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{dy};
      if (a.type == ActionType::kBackwardInput) {
        nn::DeferringGuard deferring(wstore[id]);
        torch::autograd::backward({out}, grad);
      } else {
        torch::autograd::backward({out}, grad);
        --live;
      }
      if (vs == 0) input_of.erase(id);  // nothing to send back
    }
    if (slow && faults::iteration() >= slow->start &&
        (a.type == ActionType::kForward ? slow->forward : slow->backward))
      faults::stall_since(thread_t0, slow->factor - 1.0);
    if (cpu_busy) scope.event().busy_ns = faults::thread_time_ns() - thread_t0;
    auto& [sum, n] = times[kind];
    sum += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++n;
  }
  p2p.finish();
  for (const auto& c : chunks)
    if (c.ddp != nullptr && !options.forward_only) {
      c.ddp->finish_grad_sync();
      c.ddp->set_sync(true);
    }
  for (const auto& [k, sn] : times) result.compute_time[k] = sn.first / sn.second;
  result.step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
  return result;
}

pipeline::Schedule make_schedule(const std::string& name, int p, int m, int v,
                                 const std::string& policy, int memory_limit) {
  static const char* kNames = "gpipe, 1f1b, interleaved, zero-bubble, dynamic";
  const bool known = name == "gpipe" || name == "1f1b" || name == "interleaved" ||
                     name == "zero-bubble" || name == "dynamic";
  MAPP_CHECK(known, "unknown pipeline schedule '", name, "' (expected one of ", kNames, ")");
  if (p == 1) return pipeline::one_f_one_b(1, m);
  if (name == "dynamic") {
    std::optional<int> limit;
    if (memory_limit >= 0) limit = memory_limit;
    return pipeline::dynamic(p, m, v, pipeline::parse_policy(policy), limit);
  }
  if ((name == "interleaved" || name == "1f1b") && v > 1) return pipeline::interleaved(p, m, v);
  MAPP_CHECK(v == 1, "schedule '", name,
             "' runs one model chunk per stage; with "
             "virtual_pipeline_model_parallel_size=",
             v, " use 'interleaved' or 'dynamic'");
  if (name == "gpipe") return pipeline::gpipe(p, m);
  if (name == "zero-bubble") return pipeline::zero_bubble(p, m);
  return pipeline::one_f_one_b(p, m);
}

AdaptiveSchedule::AdaptiveSchedule(int p, int m, int v, int memory_limit, int interval,
                                   const dist::ParallelState& state)
    : p_(p),
      m_(m),
      v_(v),
      memory_limit_(memory_limit),
      interval_(interval),
      state_(state),
      schedule_(make_schedule("dynamic", p, m, v, "adaptive", memory_limit)),
      sums_(static_cast<std::size_t>(4 * p), 0.0) {
  MAPP_CHECK(interval >= 1, "AdaptiveSchedule: interval must be >= 1, got ", interval);
}

bool AdaptiveSchedule::observe(const PipelineResult& result) {
  const auto& t = result.compute_time;
  auto get = [&](const char* k) {
    const auto it = t.find(k);
    return it == t.end() ? 0.0 : it->second;
  };
  double bi = get("BI"), bw = get("W");
  if (t.count("B")) bi = bw = get("B") / 2;  // a full backward: split evenly for the model
  double* row = &sums_[static_cast<std::size_t>(4 * state_.pp_rank())];
  row[0] += get("F");
  row[1] += bi;
  row[2] += bw;
  row[3] += 1;
  if (++steps_ < interval_ || p_ == 1) return false;
  // Every rank adds its stage's row; tp x dp replicas of a stage average out.
  at::Tensor all = at::tensor(sums_, at::kDouble);
  torch_ext::all_reduce_sum_(all, state_.world_group());
  pipeline::Costs costs = pipeline::Costs::uniform(p_);
  for (int s = 0; s < p_; ++s) {
    const double n = std::max(1.0, all[4 * s + 3].item<double>());
    costs.forward[s] = all[4 * s].item<double>() / n;
    costs.backward_input[s] = all[4 * s + 1].item<double>() / n;
    costs.backward_weight[s] = all[4 * s + 2].item<double>() / n;
  }
  std::optional<int> limit;
  if (memory_limit_ >= 0) limit = memory_limit_;
  pipeline::Schedule next =
      pipeline::dynamic(p_, m_, v_, pipeline::Policy::kAdaptive, limit, costs);
  const bool changed = next.actions != schedule_.actions;
  schedule_ = std::move(next);
  ++replans_;
  std::fill(sums_.begin(), sums_.end(), 0.0);
  steps_ = 0;
  return changed;
}

}  // namespace mapp
