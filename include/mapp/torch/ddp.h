// Data parallelism: the gradient reducer (GradReducer, the one engine under
// both front-ends: Python's megatronapp.distributed.DistributedDataParallel
// binds it as _C.GradReducer, C++ trainers use mapp::DistributedDataParallel
// below), the global gradient norm and clipping, and the ZeRO-1 optimizer of
// C++ trainers (megatronapp.optimizer.DistributedOptimizer's bucket layout).
//
//   mapp::DistributedDataParallel ddp(model.ptr(), st, {.compression = "int8"});
//   mapp::DistributedOptimizer opt(ddp, groups, torch::optim::AdamWOptions(3e-4));
//   opt.zero_grad();
//   for (int m = 0; m < micro; ++m) {
//     ddp.set_sync(m == micro - 1);          // accumulate, reduce during the last backward
//     (model->forward(x) / micro).backward();
//   }
//   ddp.finish_grad_sync();                  // waits for the overlapped reductions
//   double norm = opt.clip_grad_norm(1.0);   // global norm over tp x dp (x pp)
//   opt.step();                              // shard update, then all-gather of the params
//
// How it works: see GradReducer below (parameters packed into buckets, a
// readiness hook on each gradient accumulator, complete buckets submitted in
// order to the group's communication thread, codecs with error feedback,
// ZeRO-1 reduce-scatter and the parameter all-gather). The C++ front-end
// finishes once per step (finish_grad_sync, or DistributedOptimizer /
// finish_gradients); Python's finishes at the end of each backward unless a
// pipeline defers it.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "mapp/torch/comm_engine.h"
#include "mapp/torch/dist.h"

namespace torch::autograd {
struct Node;
}

namespace mapp {

// ---- the gradient reducer ------------------------------------------------------------

// One parameter handed to the reducer, with what its front-end knows of it.
struct ReducerParam {
  at::Tensor param;         // a leaf that requires grad
  bool exact = false;       // never compressed (replicated over the tensor group)
  bool expert = false;      // an MoE expert: reduced over the expert-data group
  bool own_bucket = false;  // a tied embedding: alone in its bucket (same ZeRO-1 slice
                            // on the first and the last stage)
};

struct ReducerOptions {
  std::int64_t bucket_bytes = 25LL << 20;  // target bucket size
  std::string compression = "none";        // codec spec: none, int8, onebit:32, powersgd:4, ...
  int compression_start_iter = 0;          // synchronized steps reduced exactly first
  bool overlap_grad_reduce = true;         // submit buckets during backward
  bool grad_reduce_in_fp32 = false;        // float32 main gradients for bf16/fp16 parameters
  // linear() adds weight gradients into the bucket in place (one GEMM with
  // beta = 1, no temporary, no separate add: Megatron-LM's gradient-
  // accumulation fusion) where .grad is the bucket's view
  bool gradient_accumulation_fusion = true;
  std::string group;                       // the replicas: data (x context) group
  std::string expert_group;                // experts' replicas ("": group)
  double expert_scale = 1.0;               // expert buckets are scaled by it first
};

struct GradBucket {
  int index = 0;
  std::vector<at::Tensor> params;
  std::vector<std::int64_t> offsets;  // element offset of each parameter
  std::int64_t numel = 0;             // unpadded
  at::ScalarType dtype = at::kFloat;  // of the parameters
  at::Tensor grad_data;               // the gradients (float32 main gradients; padded under ZeRO-1)
  std::vector<at::Tensor> main_grads;  // views of grad_data when it keeps main gradients
  at::Tensor param_data;              // ZeRO-1: the parameters are views into this
  at::Tensor shard;                   // ZeRO-1: this rank's averaged fp32 gradient chunk
  std::vector<std::int64_t> layout;   // (offset, rows, cols) of its matrices (PowerSGD)
  std::map<std::string, std::vector<at::Tensor>> state;  // codec spec -> state tensors
  bool exact = false;                                    // never compressed
  bool expert = false;                                   // reduced over the expert group
  std::string group;                                     // the reduction group
  std::vector<char> ready;                               // per parameter, this backward
  std::size_t n_ready = 0;
  c10::intrusive_ptr<torch_ext::CommWork> handle;  // the reduction in flight
  c10::intrusive_ptr<torch_ext::CommWork> gather;  // ZeRO-1: the parameter all-gather in flight
  torch_ext::CommStats stats;                      // of its last reduction
  bool keeps_main_grad() const { return grad_data.scalar_type() != dtype; }
};

// The bucketed, overlapped, optionally compressed gradient reduction:
//
// * Parameters in reverse order (backward produces the last layers' first) are
//   packed into contiguous buffers of about bucket_bytes, keyed by (dtype,
//   exact, expert) in order of first appearance; each .grad is a view into its
//   bucket (or, with grad_reduce_in_fp32, a bf16/fp16 parameter's float32
//   main_grads view, into which a hook adds .grad and then frees it).
// * A post hook on each parameter's gradient accumulator (added to autograd's
//   node: it never replaces a user's own hooks) marks it ready; complete
//   buckets are submitted strictly in order (every rank issues the same
//   sequence of collectives) to the group's communication thread while
//   backward goes on: an all-reduce, or under ZeRO-1 a reduce-scatter into
//   the bucket's fp32 shard, with the codec's error-feedback state per bucket.
//   Averages are SUM then divide.
// * With finish_at_backward_end (the default), the first ready hook of a
//   backward queues finish_grad_sync() on the autograd engine: backward
//   returns with averaged gradients. Pipeline executors turn it off and call
//   finish_grad_sync() once per step.
// * ZeRO-1's parameter all-gather may be started after the update and waited
//   for per bucket (start_param_sync / finish_param_sync): front-ends wait
//   just before the forward that reads a bucket's parameters.
class GradReducer {
 public:
  GradReducer(std::vector<ReducerParam> params, ReducerOptions options);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Before a forward: a reduction still in flight waited for, gradients
  // re-attached (a .grad set to None becomes its zeroed view again; a replaced
  // .grad is adopted), readiness reset, and the accumulator hooks checked (a parameter's .data changed to another dtype
  // gets a new accumulator).
  void prepare_forward();
  // Whether backward passes reduce (false: they only accumulate, no_sync()).
  void set_sync(bool enabled) { sync_ = enabled; }
  bool sync() const { return sync_; }
  void set_finish_at_backward_end(bool on) { finish_at_backward_end_ = on; }
  bool finish_at_backward_end() const { return finish_at_backward_end_; }
  // Submits the buckets not yet submitted, waits for all, records statistics;
  // a no-op when no synchronized backward ran since the last call.
  void finish_grad_sync();
  // Zeroes every bucket's gradients (main gradients included).
  void zero_grad_buffer();

  // ZeRO-1: parameters become views into per-bucket buffers padded to equal
  // chunks (world x the codec's block), reductions reduce-scatter.
  void enable_distributed_optimizer();
  bool uses_distributed_optimizer() const { return zero_; }
  // Submits every bucket's parameter all-gather and returns at once.
  void start_param_sync();
  // Waits for the all-gathers in flight of `buckets` (default: all).
  void finish_param_sync(const std::optional<std::vector<int>>& buckets = std::nullopt);
  bool gathers_pending() const { return gathers_pending_; }

  // What an optimizer with fp32 main parameters updates on this rank: under
  // ZeRO-1 (`sharded`) rank r of a bucket's group owns chunk r of its padded
  // buffer, and each parameter's part of it is a piece; otherwise every
  // parameter is one whole piece. [lo, hi) in bucket coordinates; shard_lo
  // within this rank's chunk, param_lo within the flat parameter.
  struct Piece {
    int bucket;
    int slot;  // the parameter's index in its bucket
    std::int64_t lo, hi, shard_lo, param_lo;
  };
  std::vector<Piece> pieces(bool sharded) const;
  // The mixed-precision optimizers' side of the layout, piece by piece in
  // pieces(sharded) order (the one implementation under Python's
  // MixedPrecisionOptimizer / DistributedOptimizer and C++'s
  // DistributedOptimizer): float32 copies of the pieces' current values (the
  // main parameters the inner optimizer updates), views of their averaged
  // float32 gradients (the bucket's, or with ZeRO-1 its shard's), and the
  // write-back of updated main values into the model's parameters (ZeRO-1:
  // into this rank's chunk of each bucket; the caller then all-gathers).
  std::vector<at::Tensor> main_params(bool sharded) const;
  std::vector<at::Tensor> main_grads(bool sharded) const;
  void write_back(const std::vector<at::Tensor>& mains, bool sharded);
  // [lo, hi) of bucket `b` this rank updates (ZeRO-1: its chunk; else all of it).
  std::pair<std::int64_t, std::int64_t> chunk_range(const GradBucket& b, bool sharded) const;
  // ZeRO-1, blocking: every member's updated chunk of each bucket's
  // parameters to all (start_param_sync is the overlapped form).
  void all_gather_params();

  std::vector<GradBucket>& buckets() { return buckets_; }
  const std::string& group() const { return options_.group; }
  // The codec of the next synchronized step ("none" during the warm-up).
  std::string spec() const;
  int synchronized_steps() const { return sync_steps_; }
  torch_ext::CommStats last_step_stats() const { return step_stats_; }

  // Codec state per rank (error-feedback residuals, PowerSGD's Q), keyed
  // "b<bucket>/<spec>/<i>" (the checkpoints' keys).
  std::map<std::string, at::Tensor> codec_state();
  void load_codec_state(const std::map<std::string, at::Tensor>& tensors, int synchronized_steps);

  // Called by the accumulator hooks: slot `slot` of bucket `bucket` is ready.
  void on_grad_ready(std::size_t bucket, std::size_t slot);

 private:
  void add_bucket(std::vector<at::Tensor> params, bool exact, bool expert);
  void attach_grads(GradBucket& b, bool zero);
  void hook_params();
  std::string spec_for(const GradBucket& b) const;
  std::vector<at::Tensor>& codec_state_of(GradBucket& b, const std::string& spec);
  void launch(GradBucket& b);

  ReducerOptions options_;
  std::vector<GradBucket> buckets_;
  std::size_t next_bucket_ = 0;
  bool sync_ = true;
  bool finish_at_backward_end_ = true;
  bool started_ = false;  // a synchronized backward marked a parameter ready
  bool zero_ = false;
  bool gathers_pending_ = false;
  int sync_steps_ = 0;
  torch_ext::CommStats step_stats_;
  std::mutex mu_;  // readiness and submission (hooks may run on autograd's device threads)
  // Per parameter (bucket order): its gradient accumulator (kept alive: the
  // hook lives on it) and the hook's key.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
  std::shared_ptr<bool> alive_;  // hooks that outlive the reducer do nothing
};

// ---- the C++ front-end ------------------------------------------------------------------

struct DDPOptions {
  double bucket_size_mb = 25.0;      // --ddp-bucket-size (MB), as the Python default
  std::string compression = "none";  // --grad-compression: none, int8, onebit:32, powersgd:4, ...
  int compression_start_iter = 0;    // --grad-compression-start-iter: exact until then
  bool overlap_grad_reduce = true;   // submit buckets during backward
  bool gradient_accumulation_fusion = true;  // --no-gradient-accumulation-fusion turns it off
  bool broadcast_parameters = true;  // copy data-parallel rank 0's parameters first
};

// A C++ module's data-parallel wrapper over the GradReducer (parameters'
// attributes from nn::param_attrs). Backward passes do not finish the
// reduction: call finish_grad_sync() (or DistributedOptimizer /
// finish_gradients, which do) once per step.
class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                          const dist::ParallelState& state, DDPOptions options = {});

  torch::nn::Module& module() { return *module_; }

  // Whether the next backward passes reduce (false: they only accumulate, as
  // torch DDP's no_sync()). A backward with sync on submits its buckets as
  // they fill; finish_grad_sync() submits the rest and waits.
  void set_sync(bool enabled) { reducer_->set_sync(enabled); }
  void finish_grad_sync() { reducer_->finish_grad_sync(); }
  void zero_grad_buffer();

  // ZeRO-1 (called by DistributedOptimizer).
  void enable_distributed_optimizer() { reducer_->enable_distributed_optimizer(); }
  bool uses_distributed_optimizer() const { return reducer_->uses_distributed_optimizer(); }

  GradReducer& reducer() { return *reducer_; }
  std::vector<GradBucket>& buckets() { return reducer_->buckets(); }
  const std::string& group() const { return reducer_->group(); }
  int synchronized_steps() const { return reducer_->synchronized_steps(); }
  torch_ext::CommStats last_step_stats() const { return reducer_->last_step_stats(); }
  std::map<std::string, at::Tensor> codec_state() { return reducer_->codec_state(); }
  void load_codec_state(const std::map<std::string, at::Tensor>& tensors, int synchronized_steps) {
    reducer_->load_codec_state(tensors, synchronized_steps);
  }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<GradReducer> reducer_;
};

// Without ZeRO-1 (a plain torch::optim optimizer over the model's parameters),
// after the last backward of a step: finishes the reduction, adds
// sequence-parallel partial sums over the tensor group, returns the global
// gradient norm over the model group and clips to max_norm (0: no clipping).
// As megatronapp.training.finish_gradients.
// With pipeline parallelism also sums the tied embeddings' gradients over the
// embedding group (first and last stage) and leaves the last stage's replica
// out of the norm. `chunks`: this rank's model chunks (interleaved schedules).
double finish_gradients(DistributedDataParallel& ddp, const dist::ParallelState& state,
                        double max_norm);
double finish_gradients(const std::vector<DistributedDataParallel*>& chunks,
                        const dist::ParallelState& state, double max_norm);

// Steps 2-3 of finishing a step's gradients (after the data-parallel
// reduction), the one implementation (Python's megatronapp.training.grads
// calls it through torch.ops.mapp.finish_grad_sums_): the sequence-parallel
// partial sums (`sequence_parallel`: gradients, or ZeRO-1 shards, of
// parameters replicated over the tensor group but fed a sequence shard)
// summed over `tensor_group`, and the tied word embeddings (`embedding`)
// summed over `embedding_group`; two of them on one rank (zb-v's wave puts
// the first and the last virtual stage there, and no other rank of the
// embedding group holds one) are added here instead. "" skips a group.
void finish_grad_sums_(const std::vector<at::Tensor>& sequence_parallel,
                       const std::string& tensor_group, const std::vector<at::Tensor>& embedding,
                       const std::string& embedding_group);

// The global gradient norm and clipping: the one implementation (Python's
// megatronapp.optimizer.clip_grads calls it through torch.ops.mapp.global_grad_norm
// and torch.ops.mapp.clip_grads_). `counted`: the gradients (or ZeRO-1 pieces)
// this rank counts; their squared per-tensor norms are summed in float64 on
// `device` and over `groups`. With `split_experts`, the MoE experts'
// gradients `experts` are summed apart over `expert_groups` (every expert
// shard lives on one rank there) and added. One host synchronization.
double global_grad_norm(const std::vector<at::Tensor>& counted,
                        const std::vector<std::string>& groups,
                        const std::vector<at::Tensor>& experts,
                        const std::vector<std::string>& expert_groups, bool split_experts,
                        at::Device device);
// Scales `grads` in place so that a total norm of `norm` becomes at most
// `max_norm` (nothing when max_norm <= 0 or norm <= max_norm).
void clip_grads_(const std::vector<at::Tensor>& grads, double max_norm, double norm);

// torch::optim::AdamW with torch.optim.AdamW's arithmetic (the first moment
// by lerp, the bias corrections as Python computes them), so that a C++
// trainer's update is bit for bit the Python trainer's: torch's C++ AdamW
// (mul + add) rounds the first moment differently. amsgrad is refused.
class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  at::Tensor step(LossClosure closure = nullptr) override;
};

// Loss scaling for fp16 training (Megatron-LM's semantics), the one
// implementation (Python's megatronapp.optimizer.grad_scaler binds it): the
// loss is multiplied by scale() before backward, the fp32 main gradients by
// inv_scale() before clipping, and a step with an inf or a NaN is skipped and
// reported to update(). A constant scaler keeps its scale. A dynamic one: an
// overflow spends one unit of hysteresis, and with none left multiplies the
// scale by backoff_factor (never below min_scale); growth_interval clean
// steps in a row multiply it by growth_factor and refill the hysteresis.
struct LossScalerOptions {
  double initial_scale = 4294967296.0;  // 2^32
  double min_scale = 1.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 1000;  // --loss-scale-window
  int hysteresis = 2;
};

class LossScaler {
 public:
  explicit LossScaler(double scale);                   // constant (--loss-scale S)
  explicit LossScaler(const LossScalerOptions& dynamic);  // dynamic
  double scale() const { return scale_; }
  double inv_scale() const { return 1.0 / scale_; }
  bool dynamic() const { return dynamic_; }
  void update(bool found_inf);
  int growth_tracker() const { return growth_tracker_; }
  int hysteresis_tracker() const { return hysteresis_tracker_; }
  // Restores a checkpointed state (the trackers only matter when dynamic).
  void load(double scale, int growth_tracker, int hysteresis_tracker);
  const LossScalerOptions& options() const { return options_; }

 private:
  LossScalerOptions options_;
  bool dynamic_ = false;
  double scale_ = 1.0;
  int growth_tracker_ = 0, hysteresis_tracker_ = 0;
};

// One AdamW parameter group: the model parameters and their options.
struct ParamGroup {
  std::vector<at::Tensor> params;
  torch::optim::AdamWOptions options;
};

// The part of one parameter a rank updates (checkpoints: flat [lo, hi)
// within the parameter, the fp32 main values and the AdamW state).
struct Shard {
  at::Tensor param;
  std::int64_t lo = 0, hi = 0;
  at::Tensor main;
};

// ZeRO-1 AdamW: data-parallel rank r owns chunk r of every bucket (fp32 main
// parameters and AdamW moments for 1/dp of the model); after the update the
// parameters are all-gathered. The global gradient norm counts tensor-parallel
// shards on every tensor rank and replicated parameters once, summed over the
// data group (the shards) and the model group.
class DistributedOptimizer {
 public:
  DistributedOptimizer(DistributedDataParallel& ddp, const std::vector<ParamGroup>& groups,
                       const dist::ParallelState& state);
  // Over every model chunk of this rank (interleaved pipeline schedules).
  DistributedOptimizer(const std::vector<DistributedDataParallel*>& chunks,
                       const std::vector<ParamGroup>& groups, const dist::ParallelState& state);

  void zero_grad();
  // Finishes the reduction, adds sequence-parallel partial sums over the
  // tensor group, returns the global norm (before clipping) and clips to
  // max_norm (0: no clipping).
  double clip_grad_norm(double max_norm);
  void step();
  void set_lr(double lr);

  std::vector<Shard> shards() const;
  torch::optim::AdamW& inner() { return *optimizer_; }

 private:
  struct Piece {
    DistributedDataParallel* ddp;
    at::Tensor param;
    std::int64_t param_lo, param_hi;  // the piece's elements of the flat parameter
    at::Tensor main, grad;            // float32 main values; the averaged gradient (a view)
  };
  std::vector<DistributedDataParallel*> ddps_;
  const dist::ParallelState& state_;
  std::vector<Piece> pieces_;
  std::unique_ptr<AdamW> optimizer_;
  bool finished_ = false;  // this step's gradients are finished (SP sums added)
};

}  // namespace mapp
