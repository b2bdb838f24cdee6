// Data parallelism for C++ trainers: the bucketed, overlapped, compressed
// gradient reduction of megatronapp.distributed.data_parallel.DistributedDataParallel and
// the ZeRO-1 optimizer of megatronapp.optimizer.DistributedOptimizer, with the
// same bucket layout (so a lossy codec quantizes the same blocks and a C++ run
// computes what the Python run computes).
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
// How it works (as the Python module): parameters in reverse registration
// order are packed into contiguous float buffers of about bucket_size_mb,
// keyed by (dtype, reduced exactly, expert); each param.grad is a view into
// its bucket. A post-accumulate-grad hook counts a bucket's ready parameters;
// complete buckets are submitted in order to the group's communication thread
// (torch_ext::compressed_all_reduce_async, or compressed_reduce_scatter_async
// under ZeRO-1) while backward goes on. Under tensor parallelism, parameters
// replicated over the tensor group are reduced exactly (a lossy codec would
// quantize them differently on each tensor rank). The codec's error-feedback
// state lives per bucket and is checkpointable (codec_state()).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mapp/torch/comm_engine.h"
#include "mapp/torch/dist.h"

namespace mapp {

struct DDPOptions {
  double bucket_size_mb = 25.0;      // --ddp-bucket-size (MB), as the Python default
  std::string compression = "none";  // --grad-compression: none, int8, onebit:32, powersgd:4, ...
  int compression_start_iter = 0;    // --grad-compression-start-iter: exact until then
  bool overlap_grad_reduce = true;   // submit buckets during backward
  bool broadcast_parameters = true;  // copy data-parallel rank 0's parameters first
};

struct GradBucket {
  int index = 0;
  std::vector<at::Tensor> params;
  std::vector<std::int64_t> offsets;  // element offset of each parameter
  std::int64_t numel = 0;             // unpadded
  at::Tensor grad_data;               // the gradients (padded under ZeRO-1)
  at::Tensor param_data;              // ZeRO-1: the parameters are views into this
  at::Tensor shard;                   // ZeRO-1: this rank's averaged fp32 gradient chunk
  std::vector<std::int64_t> layout;   // (offset, rows, cols) of its matrices (PowerSGD)
  std::map<std::string, std::vector<at::Tensor>> state;  // codec spec -> state tensors
  bool exact = false;                                    // never compressed
  std::string group;                                     // the reduction group
  int ready = 0;
  c10::intrusive_ptr<torch_ext::CommWork> handle;
  torch_ext::CommStats stats;
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                          const dist::ParallelState& state, DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }

  // Whether the next backward passes reduce (false: they only accumulate, as
  // torch DDP's no_sync()). A backward with sync on submits its buckets as
  // they fill; finish_grad_sync() submits the rest and waits.
  void set_sync(bool enabled) { sync_ = enabled; }
  void finish_grad_sync();
  // Zeroes every bucket's gradients (the parameters' .grad stay views).
  void zero_grad_buffer();

  // ZeRO-1 (called by DistributedOptimizer): parameters become views into
  // per-bucket buffers padded to equal chunks, reductions reduce-scatter.
  void enable_distributed_optimizer();
  bool uses_distributed_optimizer() const { return zero_; }

  std::vector<GradBucket>& buckets() { return buckets_; }
  const std::string& group() const { return group_; }
  int synchronized_steps() const { return sync_steps_; }
  torch_ext::CommStats last_step_stats() const { return step_stats_; }

  // Codec state per rank (error-feedback residuals, PowerSGD's Q), keyed
  // "b<bucket>/<spec>/<i>" as the Python DDP's codec_state_dict().
  std::map<std::string, at::Tensor> codec_state();
  void load_codec_state(const std::map<std::string, at::Tensor>& tensors, int synchronized_steps);

 private:
  void build_buckets();
  void add_bucket(std::vector<at::Tensor> params, bool exact);
  void attach_grads(GradBucket& b);
  std::string spec_for(const GradBucket& b) const;
  std::vector<at::Tensor>& codec_state_of(GradBucket& b, const std::string& spec);
  void on_grad_ready(std::size_t bucket);
  void launch(GradBucket& b);

  std::shared_ptr<torch::nn::Module> module_;
  DDPOptions options_;
  std::string group_;
  bool exact_replicated_ = false;
  std::vector<GradBucket> buckets_;
  std::size_t next_bucket_ = 0;
  bool sync_ = true;
  bool started_ = false;  // a bucket of this step was submitted or is ready
  bool zero_ = false;
  int sync_steps_ = 0;
  torch_ext::CommStats step_stats_;
  std::shared_ptr<bool> alive_;  // hooks outlive nothing they point to
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
    GradBucket* bucket;
    at::Tensor param;
    std::int64_t lo, hi;  // bucket coordinates
    std::int64_t shard_lo, param_lo;
    at::Tensor main;
  };
  std::vector<GradBucket*> all_buckets();
  std::vector<DistributedDataParallel*> ddps_;
  const dist::ParallelState& state_;
  std::vector<Piece> pieces_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  bool finished_ = false;  // this step's gradients are finished (SP sums added)
};

}  // namespace mapp
