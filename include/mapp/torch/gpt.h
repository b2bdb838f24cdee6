// A Megatron-style GPT for C++ trainers: the model of megatronapp.models.GPTModel
// (pre-LayerNorm blocks, causal attention with heads split over the tensor
// group, GELU MLP, learned positions, tied input/output embeddings, [s, b, h]
// inside, optional sequence parallelism) with the same parameters, names and
// initialization (and parameter names, e.g. layers.0.attn.qkv.weight): for the same seed a C++ rank
// holds the weights the Python rank in its place holds, and computes the same loss.
//
// Pipeline stages as in Python (Megatron's pre_process / post_process): a
// stage without pre_process takes the hidden states [s, b, h] (s/tp under
// sequence parallelism) instead of token ids; one without post_process
// returns them; layer_numbers are the global indices of its layers (each
// seeded as in Python, so a stage holds the same weights at every pp). With
// the embeddings tied across stages the last stage keeps a replica of the
// word embeddings (param_attrs: shared_embedding, shared_embedding_replica)
// whose gradient is summed with the first stage's over the embedding group
// (mapp::finish_gradients does it).
//
// Not here yet: dropout, selective recomputation, context parallelism,
// mixture of experts, untied output weights.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mapp/torch/dist.h"
#include "mapp/torch/nn.h"

namespace mapp::nn {

struct GPTConfig {
  std::int64_t vocab_size = 0;  // padded: divisible by the tensor-parallel size
  std::int64_t hidden_size = 256;
  std::int64_t num_layers = 4;
  std::int64_t num_attention_heads = 8;
  std::int64_t seq_length = 256;     // maximum sequence length (learned positions)
  std::int64_t ffn_hidden_size = 0;  // 0: 4 x hidden_size
  double init_method_std = 0.02;
  double layernorm_epsilon = 1e-5;
  bool sequence_parallel = false;
  // Full activation recomputation (Megatron's --recompute-granularity full):
  // "uniform" keeps only the input of every group of recompute_num_layers
  // consecutive layers of a stage and recomputes the group in backward;
  // "block" recomputes each of the first recompute_num_layers layers of a
  // stage. "" (default): none.
  std::string recompute_granularity;
  std::string recompute_method;
  std::int64_t recompute_num_layers = 0;
  // Throws ValueError naming the field for shapes that do not divide.
  void check(int tp_size) const;
};

class ParallelAttentionImpl : public torch::nn::Module {
 public:
  ParallelAttentionImpl(const GPTConfig& cfg, const dist::ParallelState& state, double output_std);
  at::Tensor forward(const at::Tensor& x);
  ColumnParallelLinear qkv{nullptr};  // output features ordered [head, (q, k, v), head_dim]
  RowParallelLinear proj{nullptr};

 private:
  std::int64_t heads_local_, head_dim_;
};
TORCH_MODULE(ParallelAttention);

class ParallelMLPImpl : public torch::nn::Module {
 public:
  ParallelMLPImpl(const GPTConfig& cfg, const dist::ParallelState& state, double output_std);
  at::Tensor forward(const at::Tensor& x);  // fc2(gelu_tanh(fc1(x)))
  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ParallelMLP);

class TransformerLayerImpl : public torch::nn::Module {
 public:
  TransformerLayerImpl(const GPTConfig& cfg, const dist::ParallelState& state);
  at::Tensor forward(const at::Tensor& x);  // [s, b, h] (s/tp under sequence parallelism)
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ParallelAttention attn{nullptr};
  ParallelMLP mlp{nullptr};
};
TORCH_MODULE(TransformerLayer);

// Which part of the model a pipeline stage (virtual stage) holds.
struct GPTStage {
  bool pre_process = true;                  // embeddings: takes token ids
  bool post_process = true;                 // final LayerNorm and the output layer
  std::vector<std::int64_t> layer_numbers;  // global layer indices; empty: all layers
};

class GPTModelImpl : public torch::nn::Module {
 public:
  // `seed`: every component (embeddings, each layer, the final LayerNorm) is
  // drawn from its own generator state derived from it, as in Python (default:
  // the global generator's initial seed).
  GPTModelImpl(GPTConfig cfg, const dist::ParallelState& state, std::int64_t seed = -1,
               GPTStage stage = {});
  // input_ids [b, s] (pre_process; else hidden states [s, b, h]) -> per-token
  // loss [b, s] (float32) when labels are given, else the vocabulary-sharded
  // logits [b, s, V/tp] (post_process; else hidden states [s, b, h]).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& labels = {});
  // The stage's layers, with full recomputation as configured.
  at::Tensor layers_forward(const at::Tensor& x);
  GPTConfig config;
  GPTStage stage;
  VocabParallelEmbedding word_embeddings{nullptr};
  torch::nn::Embedding position_embeddings{nullptr};
  torch::nn::ModuleList layers;
  torch::nn::LayerNorm final_layernorm{nullptr};

 private:
  std::string group_;
};
TORCH_MODULE(GPTModel);

}  // namespace mapp::nn
