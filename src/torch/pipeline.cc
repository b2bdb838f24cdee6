// mapp::forward_backward: the pipeline executor (include/mapp/torch/pipeline.h),
// the one implementation under C++ trainers and Python's
// megatronapp.pipeline.forward_backward.
#include "mapp/torch/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "c10d_util.h"
#include "mapp/common/check.h"
#include "mapp/torch/faults.h"
#include "mapp/torch/gpu_trace.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"
#include "mapp/torch/shm_p2p.h"
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

// A posted transfer: a c10d work or a shared-memory one.
struct Handle {
  c10::intrusive_ptr<c10d::Work> work;
  c10::intrusive_ptr<torch_ext::ShmWork> shm;
};

// A send issued `seconds` later from a timer thread (MAPP_INJECT_LINK_DELAY:
// a slow link; the sender does not wait). The thread runs on the producer's
// device and stream, so the send is ordered after the tensor's producer.
class DelayedSend {
 public:
  DelayedSend(std::function<Handle()> issue, double seconds, const at::Device& device) {
    std::optional<c10::Stream> stream;
    if (!device.is_cpu())
      stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
    thread_ = std::thread([this, issue = std::move(issue), seconds, stream] {
      std::optional<c10::StreamGuard> guard;
      if (stream) guard.emplace(*stream);
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      try {
        handle_ = issue();
      } catch (...) {
        error_ = std::current_exception();
      }
    });
  }
  ~DelayedSend() {
    if (thread_.joinable()) thread_.join();
  }
  DelayedSend(const DelayedSend&) = delete;
  DelayedSend& operator=(const DelayedSend&) = delete;
  // The issued send (joins the timer; rethrows what issuing threw).
  Handle& issued() {
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(error_);
    return handle_;
  }

 private:
  std::thread thread_;
  Handle handle_;
  std::exception_ptr error_;
};

// Non-blocking sends and receives to the pipeline peers, matched by tag.
class P2P {
 public:
  P2P(const PipelineGroups& g, const pipeline::Schedule& s, const PipelineOptions& o,
      PipelineResult& result)
      : g_(g), m_(s.microbatches), shape_(o.tensor_shape), dtype_(o.dtype), device_(o.device),
        trace_(o.trace_actions), result_(result) {
    if (s.stages > 1) pg_ = torch_ext::internal::resolve(g.pipeline);
    std::int64_t numel = 1;
    for (auto d : shape_) numel *= d;
    split_ = o.scatter_gather && g.tp_size > 1 && !shape_.empty() && numel % g.tp_size == 0
                 ? g.tp_size : 1;
    message_ = split_ == 1 ? shape_ : std::vector<std::int64_t>{numel / split_};
    // On one node, CPU tensors move through shared memory when the group's
    // transport is attached. A message larger than a ring would move only
    // while the sender is in a p2p call: those stay on c10d. Every stage
    // decides alike (shape and dtype are the same everywhere).
    shm_ = s.stages > 1 && device_.is_cpu() && !shape_.empty() &&
           torch_ext::shm_p2p_attached(g.pipeline) &&
           numel / split_ * static_cast<std::int64_t>(c10::elementSize(dtype_)) <=
               torch_ext::shm_p2p_ring_bytes(g.pipeline);
    result_.shared_memory = shm_;
    if (const auto d = faults::injected_link_delay();
        d && d->rank == g.stage_ranks.at(g.stage))
      for (std::size_t s2 = 0; s2 < g.stage_ranks.size(); ++s2)
        if (g.stage_ranks[s2] == d->peer) delay_ = {static_cast<int>(s2), d->ms / 1e3};
  }

  // "p2p:<src>-><dst>" of global ranks: megatronapp.trace pairs each send
  // with the receive wait that consumed it by this group and the tag.
  std::string link(int from_stage, int to_stage) const {
    return "p2p:" + std::to_string(g_.stage_ranks[from_stage]) + "->" +
           std::to_string(g_.stage_ranks[to_stage]);
  }

  int tag(const Key& k) const {
    const auto [kind, mb, vs] = k;
    return (vs * m_ + mb) * 2 + kind;
  }

  void post_recv(const Key& key, int peer) {
    MAPP_CHECK(!shape_.empty(),
               "forward_backward: tensor_shape is required with more than one pipeline stage "
               "(the shape of the activations between stages, e.g. (seq_length, "
               "micro_batch_size, hidden_size))");
    Pending r;
    r.tensor = at::empty(message_, at::TensorOptions().dtype(dtype_).device(device_));
    r.peer = peer;
    {
      std::optional<trace::Scope> scope;  // a transfer cannot complete before its receive is posted
      if (trace_) {
        scope.emplace("recv_post", trace::Category::kP2P);
        scope->event().lane = trace::kP2PLane;
        scope->event().microbatch = std::get<1>(key);
        scope->event().peer = g_.stage_ranks[peer];
        scope->event().seq = tag(key);
        scope->event().set_group(link(peer, g_.stage));
      }
      if (shm_) {
        r.handle.shm = torch_ext::shm_irecv(r.tensor, g_.pipeline, peer, tag(key));
      } else {
        std::vector<at::Tensor> one{r.tensor};
        r.handle.work = pg_->recv(one, peer, tag(key));
      }
    }
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
      std::optional<trace::Scope> scope;
      if (trace_) {
        scope.emplace("recv_wait", trace::Category::kP2P);
        scope->event().microbatch = std::get<1>(key);
        scope->event().peer = g_.stage_ranks[r.peer];
        scope->event().seq = tag(key);
        scope->event().bytes = static_cast<std::int64_t>(r.tensor.nbytes());
        scope->event().set_group(link(r.peer, g_.stage));
      }
      wait(r, "receive");
    }
    result_.recv_wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (std::get<0>(key) == 1) {
      // The gradient of this microbatch came back: the next stage ran its
      // forward, so our activation send to it completed; release it now
      // instead of holding every output until finish().
      auto s = sends_.find({0, std::get<1>(key), std::get<2>(key) + 1});
      if (s != sends_.end()) {
        Pending done = std::move(s->second);
        sends_.erase(s);
        wait(done, "send");
      }
    }
    if (split_ > 1)  // every tensor rank received its slice: put them together
      return torch_ext::all_gather(r.tensor, 0, g_.tensor).view(shape_);
    return r.tensor;
  }

  void send(const Key& key, const at::Tensor& tensor, int peer) {
    at::Tensor t = tensor.detach().contiguous();
    if (t.sizes() != at::IntArrayRef(shape_) || t.scalar_type() != dtype_)
      MAPP_CHECK(false, "forward_backward: a stage produced a tensor of shape ", t.sizes(),
                 " and dtype ", t.scalar_type(), " but tensor_shape=", at::IntArrayRef(shape_),
                 ", dtype=", dtype_, " were given; every stage boundary must match them");
    if (split_ > 1) {
      const std::int64_t k = t.numel() / split_;
      t = t.view(-1).narrow(0, g_.tp_rank * k, k);
    }
    Pending s;
    s.tensor = t;
    s.peer = peer;
    const int tg = tag(key);
    {
      std::optional<trace::Scope> scope;
      if (trace_) {
        scope.emplace("send", trace::Category::kP2P);
        scope->event().lane = trace::kP2PLane;
        scope->event().microbatch = std::get<1>(key);
        scope->event().peer = g_.stage_ranks[peer];
        scope->event().seq = tg;
        scope->event().bytes = static_cast<std::int64_t>(t.nbytes());
        scope->event().set_group(link(g_.stage, peer));
      }
      auto issue = [t, peer, tg, shm = shm_, pg = pg_, group = g_.pipeline] {
        Handle h;
        if (shm) {
          h.shm = torch_ext::shm_isend(t, group, peer, tg);
        } else {
          std::vector<at::Tensor> one{t};
          h.work = pg->send(one, peer, tg);
        }
        return h;
      };
      if (delay_ && delay_->first == peer)
        s.delayed = std::make_shared<DelayedSend>(std::move(issue), delay_->second, device_);
      else
        s.handle = issue();
    }
    result_.sent_bytes += static_cast<std::int64_t>(t.nbytes());
    sends_.emplace(key, std::move(s));
  }

  void finish() {
    std::map<Key, Pending> sends = std::move(sends_);
    sends_.clear();
    for (auto& [key, s] : sends) wait(s, "send");  // exactly once each (Gloo)
    MAPP_CHECK_STATE(recvs_.empty(), "forward_backward: ", recvs_.size(),
                     " receives were posted but never used (a malformed schedule)");
  }

 private:
  struct Pending {
    at::Tensor tensor;  // the receive buffer, or the payload kept alive until the send completes
    Handle handle;
    std::shared_ptr<DelayedSend> delayed;
    int peer = -1;
  };

  void wait(Pending& p, const char* what) {
    try {
      Handle& h = p.delayed ? p.delayed->issued() : p.handle;
      if (h.shm)
        h.shm->wait(-1);
      else
        h.work->wait(torch_ext::internal::collective_timeout());
    } catch (const std::exception& e) {
      MAPP_FAIL_BACKEND("forward_backward: pipeline ", what, " with stage ", p.peer, " on group '",
                        g_.pipeline, "' failed (stage ", g_.stage,
                        "; MAPP_COLLECTIVE_TIMEOUT_S bounds the wait): ", e.what());
    }
  }

  const PipelineGroups& g_;
  int m_;
  std::vector<std::int64_t> shape_, message_;
  at::ScalarType dtype_;
  at::Device device_;
  bool trace_;
  PipelineResult& result_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int split_ = 1;
  bool shm_ = false;
  std::optional<std::pair<int, double>> delay_;  // (peer stage, seconds)
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

// The chunks' gradient synchronizers for one step: reductions deferred to
// the step's end, sync switched per backward; the reducers' own state is
// restored on every exit (an exception included).
class SyncControl {
 public:
  SyncControl(const std::vector<PipelineChunk>& chunks, bool active) : chunks_(chunks) {
    if (!active) return;
    for (const auto& c : chunks) {
      GradReducer* r = c.reducer != nullptr ? c.reducer
                       : c.ddp != nullptr   ? &c.ddp->reducer()
                                            : nullptr;
      reducers_.push_back(r);
      saved_.emplace_back(r != nullptr && r->sync(), r != nullptr && r->finish_at_backward_end());
      if (r != nullptr) r->set_finish_at_backward_end(false);
    }
  }
  ~SyncControl() {
    for (std::size_t c = 0; c < reducers_.size(); ++c)
      if (reducers_[c] != nullptr) {
        reducers_[c]->set_sync(saved_[c].first);
        reducers_[c]->set_finish_at_backward_end(saved_[c].second);
      }
  }
  SyncControl(const SyncControl&) = delete;
  SyncControl& operator=(const SyncControl&) = delete;

  // Before a backward action of chunk c: reduce only in its final ones.
  void before_backward(int c, bool final) {
    if (reducers_.empty()) return;
    if (reducers_[c] != nullptr)
      reducers_[c]->set_sync(final && saved_[c].first);
    else if (chunks_[c].set_sync)
      chunks_[c].set_sync(final);
  }

  void finish() {
    for (std::size_t c = 0; c < reducers_.size(); ++c) {
      if (reducers_[c] != nullptr) {
        reducers_[c]->finish_grad_sync();
      } else if (chunks_[c].set_sync) {
        chunks_[c].set_sync(true);
        if (chunks_[c].finish_sync) chunks_[c].finish_sync();
      } else if (chunks_[c].finish_sync) {
        chunks_[c].finish_sync();
      }
    }
  }

 private:
  const std::vector<PipelineChunk>& chunks_;
  std::vector<GradReducer*> reducers_;
  std::vector<std::pair<bool, bool>> saved_;  // (sync, finish_at_backward_end)
};

// The trace event of one compute action: the thread's CPU time as busy time
// on a CPU device, CUDA events with gpu_busy_time.
class ComputeTrace {
 public:
  ComputeTrace(ActionType type, int mb, int chunk, const PipelineOptions& o) {
    trace::Tracer* t = trace::global();
    if (!o.trace_actions || t == nullptr || !t->enabled()) return;
    tracer_ = t;
    e_.set_name(trace_name(type));
    e_.category = trace::Category::kCompute;
    e_.lane = trace::thread_lane();
    e_.microbatch = mb;
    e_.chunk = chunk;
    if (o.gpu_busy_time && torch_ext::gpu_timers_available())
      gpu_ = torch_ext::gpu_timer_begin();
    else if (o.device.is_cpu())
      cpu0_ = faults::thread_time_ns();
    e_.start_ns = t->now_ns();
  }
  ~ComputeTrace() {  // an action that threw: its event (and a pooled GPU timer) still ends
    try {
      end();
    } catch (...) {  // the action's own error is the one to report
    }
  }
  ComputeTrace(const ComputeTrace&) = delete;
  ComputeTrace& operator=(const ComputeTrace&) = delete;
  void end() {
    if (tracer_ == nullptr) return;
    e_.end_ns = tracer_->now_ns();
    if (gpu_ >= 0) {
      torch_ext::gpu_timer_end(gpu_, e_);
    } else {
      if (cpu0_ >= 0) e_.busy_ns = faults::thread_time_ns() - cpu0_;
      tracer_->record(e_);
    }
    tracer_ = nullptr;
  }

 private:
  trace::Tracer* tracer_ = nullptr;
  trace::Event e_;
  std::int64_t gpu_ = -1, cpu0_ = -1;
};

}  // namespace

PipelineGroups PipelineGroups::of(const dist::ParallelState& st) {
  PipelineGroups g;
  g.pipeline = st.pp_size() > 1 ? st.pipeline_group() : "";
  g.stage = st.pp_rank();
  Coord c = st.grid().coord(st.rank());
  for (int s = 0; s < st.pp_size(); ++s) {
    c.pp = s;
    g.stage_ranks.push_back(st.grid().rank(c));
  }
  g.tensor = st.tensor_group();
  g.tp_rank = st.tp_rank();
  g.tp_size = st.tp_size();
  return g;
}

PipelineResult forward_backward(const pipeline::Schedule& schedule,
                                const std::vector<PipelineChunk>& chunks,
                                const std::function<at::Tensor(int)>& inputs,
                                const std::function<at::Tensor(const at::Tensor&, int)>& loss_fn,
                                const dist::ParallelState& st, const PipelineOptions& options) {
  return forward_backward(schedule, chunks, inputs, loss_fn, PipelineGroups::of(st), options);
}

PipelineResult forward_backward(const pipeline::Schedule& schedule,
                                const std::vector<PipelineChunk>& chunks,
                                const std::function<at::Tensor(int)>& inputs,
                                const std::function<at::Tensor(const at::Tensor&, int)>& loss_fn,
                                const PipelineGroups& groups, const PipelineOptions& options) {
  const int p = schedule.stages, m = schedule.microbatches, v = schedule.chunks;
  const int pp = static_cast<int>(groups.stage_ranks.size());
  MAPP_CHECK(p == pp, "forward_backward: schedule '", schedule.name, "' has ", p,
             " stages but the pipeline-parallel size is ", pp);
  MAPP_CHECK(static_cast<int>(chunks.size()) == v, "forward_backward: schedule '", schedule.name,
             "' has ", v, " chunks per stage but ", chunks.size(), " model chunks were given");
  for (std::size_t c = 0; c < chunks.size(); ++c)
    MAPP_CHECK(chunks[c].forward || chunks[c].forward_microbatch, "forward_backward: chunk ", c,
               " has no forward");
  const int stage = groups.stage;
  MAPP_CHECK(p == 1 || schedule.has_communication(), "forward_backward: schedule '", schedule.name,
             "' has no sends or receives (pipeline::add_communication inserts them)");
  std::vector<Action> actions;
  for (const Action& a : schedule.actions.at(stage))
    if (!options.forward_only || a.type == ActionType::kForward ||
        a.type == ActionType::kSendActivation || a.type == ActionType::kRecvActivation)
      actions.push_back(a);

  PipelineResult result;
  result.tensor_shape = options.tensor_shape;
  result.dtype = options.dtype;
  result.device = options.device;
  const auto t_step = std::chrono::steady_clock::now();
  P2P p2p(groups, schedule, options, result);
  const std::set<std::size_t> final =
      options.forward_only ? std::set<std::size_t>{} : final_backwards(actions);
  const int last_vs = p * v - 1;
  // Each chunk's virtual stage, and the hand-offs between two chunks of this
  // stage (wave placement): whether its input / output stays on the stage.
  std::vector<int> vstage(v);
  std::vector<bool> local_in(v), local_out(v);
  for (int c = 0; c < v; ++c) {
    const int vs = vstage[c] = schedule.vstage(stage, c);
    local_in[c] = vs > 0 && schedule.stage_of(vs - 1) == stage;
    local_out[c] = vs < last_vs && schedule.stage_of(vs + 1) == stage;
  }
  std::map<Key, at::Tensor> handed;  // (kind, mb, consuming vstage) -> tensor

  std::map<std::pair<int, int>, at::Tensor> input_of, output_of;  // (mb, chunk)
  std::map<std::pair<int, int>, nn::WeightGradStore> wstore;
  std::map<std::string, std::pair<double, int>> times;
  std::optional<at::NoGradGuard> no_grad;
  if (options.forward_only) no_grad.emplace();
  int live = 0;
  // MAPP_INJECT_SLOWDOWN naming this rank: its actions do `factor` x their work.
  std::optional<faults::Slowdown> slow;
  if (options.inject_slowdown) slow = faults::injected_slowdown();
  if (slow && (!slow->applies_to(groups.stage_ranks[stage]) || slow->factor == 1.0)) slow.reset();
  SyncControl sync(chunks, !options.forward_only);

  for (std::size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    const int mb = a.microbatch, c = a.chunk, vs = vstage[c];
    const std::pair<int, int> id{mb, c};
    switch (a.type) {
      case ActionType::kRecvActivation:
        p2p.post_recv({0, mb, vs}, a.peer);
        continue;
      case ActionType::kRecvGrad:
        p2p.post_recv({1, mb, vs}, a.peer);
        continue;
      case ActionType::kSendActivation: {
        auto it = output_of.find(id);
        MAPP_CHECK_STATE(it != output_of.end(), "forward_backward: no output of microbatch ", mb,
                         " chunk ", c, " to send (did its forward run?)");
        p2p.send({0, mb, vs + 1}, it->second, a.peer);
        if (options.forward_only) output_of.erase(it);
        continue;
      }
      case ActionType::kSendGrad: {
        auto it = input_of.find(id);
        MAPP_CHECK_STATE(it != input_of.end() && it->second.grad().defined(),
                         "forward_backward: no input gradient of microbatch ", mb, " chunk ", c,
                         " to send (did its backward run?)");
        p2p.send({1, mb, vs - 1}, it->second.grad(), a.peer);
        input_of.erase(it);
        continue;
      }
      default:
        break;
    }
    // The input of an F (kind 0) or a B/BI (kind 1): handed over by this
    // stage's other chunk (wave placement), or received.
    auto input = [&](int kind, bool local) {
      if (!local) return p2p.wait_recv({kind, mb, vs});
      auto it = handed.find({kind, mb, vs});
      MAPP_CHECK_STATE(it != handed.end(), "forward_backward: ",
                       kind == 0 ? "F" : "backward", " of microbatch ", mb, " chunk ", c,
                       kind == 0 ? " before the previous chunk's forward on this stage"
                                 : " before the next chunk's backward on this stage");
      at::Tensor t = std::move(it->second);
      handed.erase(it);
      return t;
    };
    at::Tensor x, dy;
    if (a.type == ActionType::kForward) {
      if (vs > 0) {
        x = input(0, local_in[c]);
        if (!options.forward_only) x.requires_grad_(true);
      } else if (inputs) {
        x = inputs(mb);
      }
    } else if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
               vs < last_vs) {
      dy = input(1, local_out[c]);
    }
    ComputeTrace scope(a.type, mb, c, options);
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t thread_t0 = slow ? faults::thread_time_ns() : 0;
    if (a.type == ActionType::kForward) {
      const PipelineChunk& chunk = chunks[c];
      at::Tensor out = chunk.forward_microbatch ? chunk.forward_microbatch(x, mb) : chunk.forward(x);
      if (vs == last_vs) {
        const at::Tensor loss = loss_fn ? loss_fn(out, mb) : out;
        result.losses.push_back(loss.detach());
        out = loss / m;
      }
      if (local_out[c])  // as if sent: a copy, so the two chunks share no storage
        handed[{0, mb, vs + 1}] = out.detach().clone();
      if (!(options.forward_only && (vs == last_vs || local_out[c]))) {
        input_of[id] = x;
        output_of[id] = out;
      }
      result.peak_activations = std::max(result.peak_activations, ++live);
    } else {
      sync.before_backward(c, final.count(i) > 0);
      if (a.type == ActionType::kBackwardWeight) {
        auto it = wstore.find(id);
        MAPP_CHECK_STATE(it != wstore.end(), "forward_backward: W of microbatch ", mb, " chunk ",
                         c, " before its BI");
        nn::run_weight_grads(it->second);
        wstore.erase(it);
        --live;
      } else {
        auto it = output_of.find(id);
        MAPP_CHECK_STATE(it != output_of.end(), "forward_backward: backward of microbatch ", mb,
                         " chunk ", c, " before its forward");
        const at::Tensor out = std::move(it->second);
        output_of.erase(it);
        const std::vector<at::Tensor> grad =
            vs == last_vs ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{dy};
        if (a.type == ActionType::kBackwardInput) {
          nn::DeferringGuard deferring(wstore[id]);
          torch::autograd::backward({out}, grad);
        } else {
          torch::autograd::backward({out}, grad);
          --live;
        }
        if (vs == 0) {
          input_of.erase(id);  // nothing to send back
        } else if (local_in[c]) {
          handed[{1, mb, vs - 1}] = input_of.at(id).grad();
          input_of.erase(id);
        }
      }
    }
    if (slow && faults::iteration() >= slow->start &&
        (a.type == ActionType::kForward ? slow->forward : slow->backward))
      faults::stall_since(thread_t0, slow->factor - 1.0);
    scope.end();
    auto& [sum, n] = times[pipeline::type_name(a.type)];
    sum += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++n;
  }
  p2p.finish();
  MAPP_CHECK_STATE(handed.empty(), "forward_backward: ", handed.size(),
                   " hand-offs between chunks were never used (a malformed schedule)");
  if (!options.forward_only) sync.finish();
  for (const auto& [k, sn] : times) result.compute_time[k] = sn.first / sn.second;
  result.step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
  return result;
}

pipeline::Schedule make_schedule(const std::string& name, int p, int m, int v,
                                 const std::string& policy, int memory_limit) {
  if (p == 1) {  // the name must still be one the flags accept
    const std::string known = std::string(", ") + pipeline::schedule_names() + ",";
    MAPP_CHECK(known.find(", " + name + ",") != std::string::npos, "unknown pipeline schedule '",
               name, "' (expected one of ", pipeline::schedule_names(), ")");
    return pipeline::one_f_one_b(1, m);
  }
  std::optional<int> limit;
  if (memory_limit >= 0) limit = memory_limit;
  return pipeline::by_name(name, p, m, v, policy, limit);
}

AdaptiveSchedule::AdaptiveSchedule(int p, int m, int v, int memory_limit, int interval,
                                   const dist::ParallelState& state)
    : AdaptiveSchedule(p, m, v, memory_limit, interval, PipelineGroups::of(state),
                       state.world_group()) {}

AdaptiveSchedule::AdaptiveSchedule(int p, int m, int v, int memory_limit, int interval,
                                   PipelineGroups groups, std::string world_group)
    : p_(p),
      m_(m),
      v_(v),
      memory_limit_(memory_limit),
      interval_(interval),
      groups_(std::move(groups)),
      world_(std::move(world_group)),
      schedule_(make_schedule("dynamic", p, m, v, "adaptive", memory_limit)),
      sums_(static_cast<std::size_t>(6 * p), 0.0) {
  MAPP_CHECK(interval >= 1, "AdaptiveSchedule: interval must be >= 1, got ", interval);
  MAPP_CHECK(static_cast<int>(groups_.stage_ranks.size()) == p, "AdaptiveSchedule: ", p,
             " stages but the pipeline-parallel size is ", groups_.stage_ranks.size());
}

bool AdaptiveSchedule::observe(const PipelineResult& result) {
  const auto& t = result.compute_time;
  auto get = [&](const char* k) {
    const auto it = t.find(k);
    return it == t.end() ? 0.0 : it->second;
  };
  double bi = get("BI"), bw = get("W");
  if (t.count("B")) bi = bw = get("B") / 2;  // a full backward: split evenly for the model
  double* row = &sums_[static_cast<std::size_t>(4 * groups_.stage)];
  row[0] += get("F");
  row[1] += bi;
  row[2] += bw;
  row[3] += 1;
  if (++steps_ < interval_ || p_ == 1) return false;
  if (!result.tensor_shape.empty()) probe_links(result);
  // Every rank adds its stage's row and the links it timed; tp x dp replicas
  // of a stage average out.
  at::Tensor all = at::tensor(sums_, at::kDouble);
  if (!world_.empty() && torch_ext::group_size(world_) > 1)
    torch_ext::all_reduce_sum_(all, world_);
  pipeline::Costs costs = pipeline::Costs::uniform(p_);
  for (int s = 0; s < p_; ++s) {
    const double n = std::max(1.0, all[4 * s + 3].item<double>());
    costs.forward[s] = all[4 * s].item<double>() / n;
    costs.backward_input[s] = all[4 * s + 1].item<double>() / n;
    costs.backward_weight[s] = all[4 * s + 2].item<double>() / n;
    costs.p2p[s] = all[4 * p_ + 2 * s].item<double>() /
                   std::max(1.0, all[4 * p_ + 2 * s + 1].item<double>());
  }
  std::optional<int> limit;
  if (memory_limit_ >= 0) limit = memory_limit_;
  pipeline::Schedule next =
      pipeline::dynamic(p_, m_, v_, pipeline::Policy::kAdaptive, limit, costs);
  const bool changed = next.actions != schedule_.actions;
  schedule_ = std::move(next);
  costs_ = std::move(costs);
  ++replans_;
  std::fill(sums_.begin(), sums_.end(), 0.0);
  steps_ = 0;
  return changed;
}

// Median one-way time of one activation over each link this rank touches
// (links in increasing order on every rank: no deadlock); the lower stage of
// a link counts it.
void AdaptiveSchedule::probe_links(const PipelineResult& result) {
  constexpr int kRounds = 3;
  const int stage = groups_.stage;
  auto pg = torch_ext::internal::resolve(groups_.pipeline);
  std::vector<at::Tensor> buf{at::zeros(
      result.tensor_shape, at::TensorOptions().dtype(result.dtype).device(result.device))};
  auto wait = [&](c10::intrusive_ptr<c10d::Work> w, int peer) {
    try {
      w->wait(torch_ext::internal::collective_timeout());
    } catch (const std::exception& e) {
      MAPP_FAIL_BACKEND("AdaptiveSchedule: the link probe with stage ", peer, " on group '",
                        groups_.pipeline, "' failed (stage ", stage, "): ", e.what());
    }
  };
  const int links = v_ > 1 ? p_ : p_ - 1;
  for (int link = 0; link < links; ++link) {
    const int a = link, b = (link + 1) % p_;
    if ((stage != a && stage != b) || a == b) continue;
    const int peer = stage == a ? b : a;
    std::vector<double> times;
    for (int r = 0; r < kRounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      if (stage == a) {
        wait(pg->send(buf, peer, 0), peer);
        wait(pg->recv(buf, peer, 0), peer);
      } else {
        wait(pg->recv(buf, peer, 0), peer);
        wait(pg->send(buf, peer, 0), peer);
      }
      times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 2);
    }
    if (stage == a) {  // count each link once
      std::sort(times.begin(), times.end());
      sums_[static_cast<std::size_t>(4 * p_ + 2 * link)] += times[kRounds / 2];
      sums_[static_cast<std::size_t>(4 * p_ + 2 * link + 1)] += 1;
    }
  }
}

}  // namespace mapp
