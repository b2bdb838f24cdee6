// Tensor-parallel layers for C++ trainers, as torch::nn::Modules with the
// weight layouts, initialization and communication of the Python modules
// (megatronapp.tensor_parallel): for the same seed a C++ rank holds the same
// weight shard as the Python rank in its place, and computes the same thing.
//
//   auto st = mapp::dist::init_from_env({.tp = 2});
//   torch::manual_seed(1234);                       // same seed on every rank
//   mapp::nn::ColumnParallelLinear fc1(mapp::nn::ColumnParallelLinearOptions(64, 256), st);
//   mapp::nn::RowParallelLinear fc2(mapp::nn::RowParallelLinearOptions(256, 64), st);
//   at::Tensor y = fc2(at::gelu(fc1(x)));          // one all-reduce forward, one backward
//
// Weights are drawn whole (the master tensor, float32, from the global CPU
// generator) and sliced, so the model is the same function at every tp.
// Communication runs through the mapp operators on the state's registered
// tensor group, as torch::autograd::Functions (forward / backward pairs of
// Megatron's mappings: copy / all-reduce, gather / split, and with sequence
// parallelism all-gather / reduce-scatter along dim 0).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mapp/torch/dist.h"

namespace mapp::nn {

// ---- what the training pieces need to know of a parameter -------------------------------
// The Python layers keep these as tensor attributes (tensor_model_parallel,
// partition_dim, sequence_parallel, shared_embedding); a C++ tensor carries
// them here, keyed by the parameter's TensorImpl (set_data keeps it, so ZeRO-1
// buffers do not lose them). sharded_parameter marks its shards; the layers
// mark sequence-parallel partial sums.
struct ParamAttrs {
  bool tensor_parallel = false;    // a shard along partition_dim: counts on every tensor rank
  int partition_dim = -1;          // the dim split over the tensor group (-1: replicated)
  bool sequence_parallel = false;  // replicated, fed a sequence shard: its gradient is partial
  bool shared_embedding = false;   // tied word embeddings on the first and last stage
  // the last stage's copy of tied embeddings: not counted in the gradient norm
  // (the first stage counts it)
  bool shared_embedding_replica = false;
  // Gradient-accumulation fusion (Megatron-LM's --gradient-accumulation-fusion):
  // the owner of this parameter's .grad (the DDP reducer, whose bucket view it
  // is) lets linear() add the weight gradient into .grad in place, one GEMM with
  // beta = 1, instead of a temporary that AccumulateGrad then adds.
  bool accumulate_wgrad_in_place = false;
};
void set_param_attrs(const at::Tensor& param, const ParamAttrs& attrs);
ParamAttrs param_attrs(const at::Tensor& param);  // defaults for an unmarked tensor
// Marks every parameter of `module` as a sequence-parallel partial sum.
void mark_sequence_parallel(torch::nn::Module& module);

// ---- tensor-parallel mappings (autograd) -----------------------------------------------
// The one implementation: Python's megatronapp.tensor_parallel.mappings and
// vocab_parallel_cross_entropy call these through torch.ops.mapp.tp_* (ops.cc).
// forward identity, backward all-reduce (the input of a column-parallel layer)
at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const std::string& group);
// forward all-reduce, backward identity (the output of a row-parallel layer)
at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const std::string& group);
// forward all-gather of the last dim, backward this rank's slice
at::Tensor gather_from_tensor_parallel(const at::Tensor& x, const std::string& group);
// forward this rank's slice of the last dim, backward all-gather
at::Tensor scatter_to_tensor_parallel(const at::Tensor& x, const std::string& group);
// forward this rank's slice of dim 0 (sequence), backward all-gather
at::Tensor scatter_to_sequence_parallel(const at::Tensor& x, const std::string& group);
// forward all-gather of dim 0 (sequence), backward reduce-scatter (or, when
// !tensor_parallel_output_grad — the consumer's gradient is the same on every
// member — this rank's slice)
at::Tensor gather_from_sequence_parallel(const at::Tensor& x, const std::string& group,
                                         bool tensor_parallel_output_grad = true);
// forward reduce-scatter of dim 0, backward all-gather
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& x, const std::string& group);

// ---- deferred weight gradients (zero-bubble BI / W) -------------------------------------
// megatronapp.autograd in C++: linear() is at::linear whose backward always
// returns the input gradient and, while a DeferringGuard is active, stores a
// closure for the weight gradient instead of computing it (the bias gradient
// is computed now). run_weight_grads() evaluates the closures and accumulates
// them through autograd, so post-accumulate hooks (the DDP's) fire as usual.
// A closure that accumulated into .grad in place (gradient-accumulation
// fusion) returns an undefined tensor; its accumulator's post hooks are run.
// The active store is process-wide, not thread-local (autograd may run
// backward functions on device threads).
class WeightGradStore {
 public:
  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }

 private:
  friend class DeferringGuard;
  friend WeightGradStore* set_active_weight_grad_store(WeightGradStore*);
  friend bool defer(const at::Tensor&, std::function<at::Tensor()>);
  friend bool is_deferred(const at::Tensor&);
  friend void run_weight_grads(WeightGradStore&);
  std::vector<std::pair<at::Tensor, std::function<at::Tensor()>>> items_;
  std::vector<const c10::TensorImpl*> deferred_;
};

// Inside, deferrable layers put their weight gradients into `store`.
class DeferringGuard {
 public:
  explicit DeferringGuard(WeightGradStore& store);
  ~DeferringGuard();
  DeferringGuard(const DeferringGuard&) = delete;
  DeferringGuard& operator=(const DeferringGuard&) = delete;

 private:
  WeightGradStore* previous_;
};

// Makes `store` (nullptr: none) the active store and returns the previous
// one (front-ends without RAII scopes: the Python `deferring` context).
WeightGradStore* set_active_weight_grad_store(WeightGradStore* store);

// Inside a deferring backward: stores `wgrad` (returns `param`'s gradient, or
// an undefined tensor once it added it into `param`'s .grad) and returns
// true; outside one returns false (compute the gradient now).
bool defer(const at::Tensor& param, std::function<at::Tensor()> wgrad);
// Whether `param`'s gradient was put aside by the active deferring backward
// (autograd may still run its post-accumulate hooks, without a gradient).
bool is_deferred(const at::Tensor& param);
// Computes the stored gradients and accumulates them through autograd; empties the store.
void run_weight_grads(WeightGradStore& store);
// The weight gradient dy^T x of y = x W^T over every leading dim. When
// `may_fuse` (not a double backward) and `weight` allows it
// (ParamAttrs::accumulate_wgrad_in_place, a defined .grad of the same dtype
// and shape, no user hook on its gradient) it is added into weight.grad() by
// one GEMM with beta = 1 and an undefined tensor is returned.
at::Tensor linear_weight_grad(const at::Tensor& weight, const at::Tensor& dy, const at::Tensor& x,
                              bool may_fuse = true);
// y = x W^T + b whose weight gradient can be deferred.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// The full tensor of `shape` initialized by `init` (float32, global CPU
// generator), then this tensor rank's chunk along `partition_dim` (-1: the
// whole tensor), as a parameter of `dtype`.
using InitMethod = std::function<void(at::Tensor&)>;
at::Tensor sharded_parameter(at::IntArrayRef shape, int partition_dim, int tp_size, int tp_rank,
                             const InitMethod& init, at::ScalarType dtype = at::kFloat);

// nn.Linear's initialization: kaiming_uniform(a = sqrt(5)) weights, and
// uniform(+-1/sqrt(fan_in)) biases.
void linear_weight_init(at::Tensor& weight);
InitMethod linear_bias_init(std::int64_t fan_in);

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(std::int64_t in, std::int64_t out)
      : in_features_(in), out_features_(out) {}
  TORCH_ARG(std::int64_t, in_features);
  TORCH_ARG(std::int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, gather_output) = false;
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  // Replaces the default initialization of the (full) weight; biases are then zeros.
  TORCH_ARG(InitMethod, init_method) = nullptr;
};

// Y = X A^T + b with A split by rows (output features): weight [out/tp, in],
// bias [out/tp]; the output is this rank's slice of the last dim (or the
// whole of it with gather_output). Sequence parallel: X is [s/tp, b, in].
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options,
                           const dist::ParallelState& state);
  at::Tensor forward(const at::Tensor& x);
  ColumnParallelLinearOptions options;
  std::string group;
  at::Tensor weight, bias;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(std::int64_t in, std::int64_t out)
      : in_features_(in), out_features_(out) {}
  TORCH_ARG(std::int64_t, in_features);
  TORCH_ARG(std::int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, input_is_parallel) = true;
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  // Replaces the default initialization of the (full) weight; biases are then zeros.
  TORCH_ARG(InitMethod, init_method) = nullptr;
};

// Y = X A^T + b with A split by columns (input features): weight [out, in/tp],
// bias [out] added once after the all-reduce (reduce-scatter along dim 0
// under sequence parallelism).
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(const RowParallelLinearOptions& options, const dist::ParallelState& state);
  at::Tensor forward(const at::Tensor& x);
  RowParallelLinearOptions options;
  std::string group;
  at::Tensor weight, bias;
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(std::int64_t num, std::int64_t dim)
      : num_embeddings_(num), embedding_dim_(dim) {}
  TORCH_ARG(std::int64_t, num_embeddings);
  TORCH_ARG(std::int64_t, embedding_dim);
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  // Replaces the default initialization of the (full) weight; biases are then zeros.
  TORCH_ARG(InitMethod, init_method) = nullptr;
};

// The embedding table split by rows (vocabulary): weight [V/tp, D], rows
// [r V/tp, (r+1) V/tp) on tensor rank r, normal(0, 1) initialized. Ids
// outside [0, V) are an error.
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options,
                             const dist::ParallelState& state);
  at::Tensor forward(const at::Tensor& ids);
  VocabParallelEmbeddingOptions options;
  std::string group;
  std::int64_t vocab_start = 0, vocab_end = 0;
  at::Tensor weight;
};
TORCH_MODULE(VocabParallelEmbedding);

// Per-token cross-entropy of logits sharded on the last dim ([..., V/tp];
// target [...] holds global ids): float32 [...], 0 (and no gradient) where
// target == ignore_index. One all-gather of 3 floats per token.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const std::string& group, std::int64_t ignore_index = -100);

}  // namespace mapp::nn
