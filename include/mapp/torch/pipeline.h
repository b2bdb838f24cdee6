// The pipeline executor, the one implementation behind both front-ends: C++
// trainers call mapp::forward_backward directly, and Python's
// megatronapp.pipeline.forward_backward passes its model chunks, data and loss
// in as callables (_C.pipeline.forward_backward). It runs this rank's actions
// of a schedule of the C++ IR (mapp/pipeline/schedule.h: GPipe, 1F1B,
// interleaved, zero-bubble, ZB-V, dynamic, or one imported from CSV/JSON):
//
//   auto sched = mapp::pipeline::one_f_one_b(st.pp_size(), micro);
//   mapp::PipelineResult r = mapp::forward_backward(
//       sched, {{[&](const at::Tensor& x) { return model->forward(x); }, &ddp}},
//       [&](int mb) { return ids[mb]; },                                 // first stage
//       [&](const at::Tensor& logits, int mb) { return loss_of(logits, mb); },  // last stage
//       st, {.tensor_shape = {seq, micro_batch, hidden}});
//
// Actions run in order. RECV_* posts a non-blocking receive and SEND_* a
// non-blocking send on the pipeline group (several in flight, matched by tag =
// (kind, microbatch, virtual stage)); F, B and BI wait only for their own
// input. The last virtual stage divides each microbatch's loss by the number
// of microbatches before backward. BI computes the input gradient with the
// weight gradients of mapp::nn::linear (and of closures given to nn::defer)
// deferred (mapp/torch/nn.h) and W computes them later. In the wave placement
// (ZB-V) the turn from one chunk to the next stays on this stage: the output
// is handed over as if it had arrived (a copy), and so is the input gradient.
// A chunk's gradient synchronizer (its DDP / reducer) reduces only during the
// chunk's final B/BI and final W, so its reduction overlaps the other chunks'
// compute; every chunk's reduction is finished before return.
//
// Transports: on one node, CPU tensors go through the group's shared-memory
// P2P transport when it is attached (torch_ext::shm_p2p_attach) and a message
// fits one ring, else through c10d (Gloo / NCCL). With scatter_gather each
// tensor rank sends only its 1/tp slice and the receivers all-gather over the
// tensor group (Megatron-LM's scatter/gather, for tensors equal on every
// tensor rank). MAPP_INJECT_LINK_DELAY delays this rank's messages to a peer
// from a timer thread, and MAPP_INJECT_SLOWDOWN stretches its compute
// (faults.h). Every wait is bounded by MAPP_COLLECTIVE_TIMEOUT_S: a peer that
// never sends is an error naming the transfer, not a hang. An exception from
// a chunk, the loss or autograd propagates after the executor has restored
// the synchronizers' state.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "mapp/pipeline/schedule.h"
#include "mapp/torch/ddp.h"
#include "mapp/torch/dist.h"

namespace mapp {

// One model chunk of this stage: virtual stage chunk * pp + pp_rank.
struct PipelineChunk {
  // input (token ids on the first virtual stage, else the previous stage's
  // output) -> output (the logits or per-token values on the last virtual
  // stage, which loss_fn reduces; else what the next stage receives).
  std::function<at::Tensor(const at::Tensor&)> forward;
  DistributedDataParallel* ddp = nullptr;  // optional: gradient synchronization
  // Instead of `forward`: (input, microbatch) -> output, for chunks whose
  // forward takes per-microbatch arguments (a packed microbatch's documents).
  // On the first virtual stage the input is what `inputs(mb)` returned
  // (undefined when it returned none: the chunk reads its own microbatch).
  std::function<at::Tensor(const at::Tensor&, int)> forward_microbatch;
  // Instead of `ddp`: its reducer (the Python DDP front-end's).
  GradReducer* reducer = nullptr;
  // Any other synchronizer: set_sync(false) before a backward that only
  // accumulates, set_sync(true) before one that reduces (and after the
  // step), finish_sync() once at the end of the step.
  std::function<void(bool)> set_sync;
  std::function<void()> finish_sync;
};

struct PipelineOptions {
  std::vector<std::int64_t> tensor_shape;  // of the tensors between stages
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;  // of the received tensors (CUDA with NCCL groups)
  bool forward_only = false;     // evaluation: the forwards only, without autograd
  // Tensors between stages are equal on every tensor rank (tensor parallelism
  // without sequence parallelism): send 1/tp, all-gather on arrival.
  bool scatter_gather = false;
  // MAPP_INJECT_SLOWDOWN naming this rank stretches its F / B / BI / W
  // actions (Python's trainer slows its layers with hooks instead: false).
  bool inject_slowdown = true;
  // Per-microbatch compute and P2P trace events (false: coarse granularity).
  bool trace_actions = true;
  // Compute events' busy time from CUDA events (gpu_trace.h; the caller
  // resolves them, e.g. megatronapp.trace.begin_iteration).
  bool gpu_busy_time = false;
};

// Where this rank sits in the pipeline: the c10d group of its stages
// (members in stage order) and, for scatter/gather, its tensor group.
struct PipelineGroups {
  std::string pipeline;          // c10d group name ("" with one stage)
  int stage = 0;                 // this rank's stage = its rank in `pipeline`
  std::vector<int> stage_ranks;  // global rank of each stage (trace, fault injection)
  std::string tensor;            // tensor-parallel group name
  int tp_rank = 0, tp_size = 1;
  static PipelineGroups of(const dist::ParallelState& state);
};

struct PipelineResult {
  std::vector<at::Tensor> losses;              // last stage: per-microbatch loss (detached)
  int peak_activations = 0;                    // most microbatch-chunk activations held at once
  std::map<std::string, double> compute_time;  // "F", "B", "BI", "W" -> mean seconds
  double recv_wait_seconds = 0;                // waiting for inputs
  std::int64_t sent_bytes = 0;                 // to pipeline peers
  double step_seconds = 0;
  bool shared_memory = false;  // transfers went through the shared-memory transport
  // The options' tensors between stages (AdaptiveSchedule probes its links with one).
  std::vector<std::int64_t> tensor_shape;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
};

// Runs one step of `schedule` (stages = the pipeline size, chunks =
// chunks.size()) on this rank. `inputs(mb)` feeds the first virtual stage
// (may be empty: see PipelineChunk::forward_microbatch); `loss_fn(output,
// mb)` returns the scalar loss on the last (empty: the last chunk's output is
// its loss). Throws ValueError for a schedule that does not fit the groups or
// the chunks, a stage output whose shape or dtype differs from tensor_shape /
// dtype, and a schedule that mixes B and BI/W within one chunk.
PipelineResult forward_backward(const pipeline::Schedule& schedule,
                                const std::vector<PipelineChunk>& chunks,
                                const std::function<at::Tensor(int)>& inputs,
                                const std::function<at::Tensor(const at::Tensor&, int)>& loss_fn,
                                const PipelineGroups& groups, const PipelineOptions& options);
PipelineResult forward_backward(const pipeline::Schedule& schedule,
                                const std::vector<PipelineChunk>& chunks,
                                const std::function<at::Tensor(int)>& inputs,
                                const std::function<at::Tensor(const at::Tensor&, int)>& loss_fn,
                                const dist::ParallelState& state, const PipelineOptions& options);

// --pipeline-schedule NAME as pretrain_gpt.py reads it (pipeline::by_name:
// gpipe, 1f1b (with v > 1 interleaved), interleaved, zero-bubble, zb-v,
// dynamic with `policy` dfc, bfc, auto, adaptive; `memory_limit` < 0: the
// planner's default). One stage is always the one-stage 1F1B. ValueError for
// combinations that cannot run.
pipeline::Schedule make_schedule(const std::string& name, int p, int m, int v = 1,
                                 const std::string& policy = "adaptive", int memory_limit = -1);

// The dynamic planner fed with measured times, the one implementation under
// megatronapp.pipeline.AdaptiveSchedule and C++ trainers: every rank records
// its stage's mean F / BI / W times (a full B split evenly between BI and W);
// every `interval` steps each link s <-> s+1 is timed by a short ping-pong of
// one activation between its two stages (median of 3; send completion cannot
// be observed reliably on every backend while a step runs), then one
// all-reduce over the world averages stage and link times and every rank
// re-plans dynamic(policy adaptive, costs) — the same deterministic
// computation on the same numbers, so every rank (and every data-parallel
// replica) gets the same plan.
class AdaptiveSchedule {
 public:
  // `memory_limit` < 0: the planner's default.
  AdaptiveSchedule(int p, int m, int v, int memory_limit, int interval,
                   const dist::ParallelState& state);
  // Without a dist::ParallelState (Python): the pipeline's groups and the
  // c10d group every rank joins for the all-reduce (the world; "" when the
  // process runs alone).
  AdaptiveSchedule(int p, int m, int v, int memory_limit, int interval, PipelineGroups groups,
                   std::string world_group);
  const pipeline::Schedule& schedule() const { return schedule_; }
  // Records one step; every `interval` calls re-plans (a collective over the
  // world: call it on every rank). Returns whether the schedule changed.
  bool observe(const PipelineResult& result);
  int replans() const { return replans_; }
  // The measured costs of the last re-plan (none before the first).
  const std::optional<pipeline::Costs>& costs() const { return costs_; }

 private:
  void probe_links(const PipelineResult& result);

  int p_, m_, v_, memory_limit_, interval_;
  PipelineGroups groups_;
  std::string world_;
  pipeline::Schedule schedule_;
  std::vector<double> sums_;  // per stage: F, BI, W, samples; then per link: seconds, samples
  std::optional<pipeline::Costs> costs_;
  int steps_ = 0, replans_ = 0;
};

}  // namespace mapp
