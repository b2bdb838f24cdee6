// A Megatron-style GPT for C++ trainers: the model of megatronapp.models.GPTModel
// (pre-LayerNorm blocks, causal attention with heads split over the tensor
// group, GELU MLP, learned positions, tied input/output embeddings, [s, b, h]
// inside, optional sequence parallelism) with the same parameters, names and
// initialization (and parameter names, e.g. layers.0.attn.qkv.weight): for the same seed a C++ rank
// holds the weights the Python rank in its place holds, and computes the same loss.
//
// Not here yet: dropout, recomputation, pipeline stages, context parallelism,
// mixture of experts, untied output weights (GPTConfig refuses them).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

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

class GPTModelImpl : public torch::nn::Module {
 public:
  // `seed`: every component (embeddings, each layer, the final LayerNorm) is
  // drawn from its own generator state derived from it, as in Python (default:
  // the global generator's initial seed).
  GPTModelImpl(GPTConfig cfg, const dist::ParallelState& state, std::int64_t seed = -1);
  // input_ids [b, s] -> per-token loss [b, s] (float32) when labels are given,
  // else the vocabulary-sharded logits [b, s, V/tp].
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& labels = {});
  GPTConfig config;
  VocabParallelEmbedding word_embeddings{nullptr};
  torch::nn::Embedding position_embeddings{nullptr};
  torch::nn::ModuleList layers;
  torch::nn::LayerNorm final_layernorm{nullptr};

 private:
  std::string group_;
};
TORCH_MODULE(GPTModel);

}  // namespace mapp::nn
