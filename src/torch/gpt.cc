// mapp::nn::GPTModel: megatronapp.models.GPTModel in C++ (include/mapp/torch/gpt.h).
#include "mapp/torch/gpt.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

#include "mapp/common/check.h"
#include "mapp/torch/ops.h"

namespace mapp::nn {
namespace {

InitMethod normal(double std) {
  return [std](at::Tensor& t) { t.normal_(0.0, std); };
}

// Runs `body` with the global CPU generator seeded for `component` of a
// model seeded with `base` (Python's _seeded: base * 1000003 + 7919 *
// (component + 1) modulo 2^63 - 1), and restores the generator after.
template <typename Body>
void seeded(std::uint64_t base, std::int64_t component, Body&& body) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
  }
  const unsigned __int128 mod = (static_cast<unsigned __int128>(1) << 63) - 1;
  const unsigned __int128 seed = (static_cast<unsigned __int128>(base) * 1000003u +
                                  7919u * static_cast<unsigned __int128>(component + 1)) %
                                 mod;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(static_cast<std::uint64_t>(seed));
  }
  body();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(saved);
}

// Full recomputation: forward without keeping the graph (only the input is
// saved); backward runs `fn` again with autograd on and back-propagates
// through it (reentrant, as Megatron's CheckpointFunction). Inside a
// zero-bubble BI the recomputed layers' weight gradients are deferred as any.
struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(std::function<at::Tensor(const at::Tensor&)> f) : fn(std::move(f)) {}
  std::function<at::Tensor(const at::Tensor&)> fn;
};

struct Recompute : torch::autograd::Function<Recompute> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::function<at::Tensor(const at::Tensor&)>& fn) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(c10::make_intrusive<FnHolder>(fn));
    at::NoGradGuard no_grad;
    return fn(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto holder =
        c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      y = holder->fn(x);
    }
    torch::autograd::backward({y}, {g[0]});
    return {x.grad(), at::Tensor()};
  }
};

}  // namespace

void GPTConfig::check(int tp) const {
  MAPP_CHECK(vocab_size > 0, "GPTConfig.vocab_size must be set (the padded vocabulary)");
  MAPP_CHECK(hidden_size % num_attention_heads == 0, "hidden_size (", hidden_size,
             ") is not divisible by num_attention_heads (", num_attention_heads, ")");
  const std::int64_t ffn = ffn_hidden_size ? ffn_hidden_size : 4 * hidden_size;
  for (const auto& [name, v] : {std::pair<const char*, std::int64_t>{"vocab_size", vocab_size},
                                {"num_attention_heads", num_attention_heads},
                                {"ffn_hidden_size", ffn}})
    MAPP_CHECK(v % tp == 0, name, " (", v, ") is not divisible by the tensor-parallel size ", tp);
  MAPP_CHECK(recompute_granularity.empty() || recompute_granularity == "full",
             "--recompute-granularity ", recompute_granularity,
             ": the C++ GPT has 'full' (selective "
             "recomputation is not available from C++ yet)");
  if (recompute_granularity == "full") {
    MAPP_CHECK(recompute_method == "uniform" || recompute_method == "block",
               "--recompute-granularity full needs --recompute-method uniform or block");
    MAPP_CHECK(recompute_num_layers >= 1,
               "--recompute-granularity full needs --recompute-num-layers N (N >= 1): layers per "
               "recomputed group (uniform) or the first N layers of each stage (block)");
  } else {
    MAPP_CHECK(recompute_method.empty(), "--recompute-method ", recompute_method,
               " applies only to --recompute-granularity full");
  }
}

ParallelAttentionImpl::ParallelAttentionImpl(const GPTConfig& cfg, const dist::ParallelState& st,
                                             double output_std)
    : heads_local_(cfg.num_attention_heads / st.tp_size()),
      head_dim_(cfg.hidden_size / cfg.num_attention_heads) {
  const bool sp = cfg.sequence_parallel;
  qkv = register_module(
      "qkv", ColumnParallelLinear(ColumnParallelLinearOptions(cfg.hidden_size, 3 * cfg.hidden_size)
                                      .sequence_parallel(sp)
                                      .init_method(normal(cfg.init_method_std)),
                                  st));
  proj = register_module(
      "proj", RowParallelLinear(RowParallelLinearOptions(cfg.hidden_size, cfg.hidden_size)
                                    .sequence_parallel(sp)
                                    .init_method(normal(output_std)),
                                st));
}

at::Tensor ParallelAttentionImpl::forward(const at::Tensor& x) {
  at::Tensor qkv_out = qkv(x);  // [s, b, heads_local * 3 * head_dim]
  const std::int64_t s = qkv_out.size(0), b = qkv_out.size(1);
  const auto parts = qkv_out.view({s, b, heads_local_, 3, head_dim_}).unbind(3);
  // [b, heads, s, d] each
  const at::Tensor q = parts[0].permute({1, 2, 0, 3}), k = parts[1].permute({1, 2, 0, 3}),
                   v = parts[2].permute({1, 2, 0, 3});
  at::Tensor ctx = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  ctx = ctx.permute({2, 0, 1, 3}).reshape({s, b, heads_local_ * head_dim_});
  return proj(ctx);
}

ParallelMLPImpl::ParallelMLPImpl(const GPTConfig& cfg, const dist::ParallelState& st,
                                 double output_std) {
  const std::int64_t ffn = cfg.ffn_hidden_size ? cfg.ffn_hidden_size : 4 * cfg.hidden_size;
  fc1 =
      register_module("fc1", ColumnParallelLinear(ColumnParallelLinearOptions(cfg.hidden_size, ffn)
                                                      .sequence_parallel(cfg.sequence_parallel)
                                                      .init_method(normal(cfg.init_method_std)),
                                                  st));
  fc2 = register_module("fc2", RowParallelLinear(RowParallelLinearOptions(ffn, cfg.hidden_size)
                                                     .sequence_parallel(cfg.sequence_parallel)
                                                     .init_method(normal(output_std)),
                                                 st));
}

at::Tensor ParallelMLPImpl::forward(const at::Tensor& x) { return fc2(at::gelu(fc1(x), "tanh")); }

TransformerLayerImpl::TransformerLayerImpl(const GPTConfig& cfg, const dist::ParallelState& st) {
  // GPT-2 / Megatron scaled init of the output projections.
  const double output_std =
      cfg.init_method_std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  auto ln = [&] {
    return torch::nn::LayerNorm(
        torch::nn::LayerNormOptions({cfg.hidden_size}).eps(cfg.layernorm_epsilon));
  };
  ln1 = register_module("ln1", ln());
  attn = register_module("attn", ParallelAttention(cfg, st, output_std));
  ln2 = register_module("ln2", ln());
  mlp = register_module("mlp", ParallelMLP(cfg, st, output_std));
  if (cfg.sequence_parallel && st.tp_size() > 1) {  // LayerNorms see a sequence shard
    mark_sequence_parallel(*ln1);
    mark_sequence_parallel(*ln2);
  }
}

at::Tensor TransformerLayerImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + attn(ln1(x));
  return h + mlp(ln2(h));
}

GPTModelImpl::GPTModelImpl(GPTConfig cfg, const dist::ParallelState& st, std::int64_t seed,
                           GPTStage stage_)
    : config(std::move(cfg)), stage(std::move(stage_)), group_(st.tensor_group()) {
  config.check(st.tp_size());
  if (config.sequence_parallel && st.tp_size() == 1) config.sequence_parallel = false;
  MAPP_CHECK(st.cp_size() == 1,
             "mapp::nn::GPTModel: context parallelism is not available from C++ yet (cp ",
             st.cp_size(), ")");
  if (stage.layer_numbers.empty())
    for (std::int64_t i = 0; i < config.num_layers; ++i) stage.layer_numbers.push_back(i);
  for (const std::int64_t i : stage.layer_numbers)
    MAPP_CHECK(i >= 0 && i < config.num_layers, "mapp::nn::GPTModel: layer number ", i,
               " outside [0, ", config.num_layers, ")");
  const std::uint64_t base = seed >= 0 ? static_cast<std::uint64_t>(seed)
                                       : at::detail::getDefaultCPUGenerator().current_seed();
  // Tied embeddings: the last stage holds a replica of the word embeddings.
  const bool split = !(stage.pre_process && stage.post_process);
  if (stage.pre_process || stage.post_process) {
    seeded(base, 0, [&] {
      word_embeddings =
          register_module("word_embeddings",
                          VocabParallelEmbedding(
                              VocabParallelEmbeddingOptions(config.vocab_size, config.hidden_size)
                                  .init_method(normal(config.init_method_std)),
                              st));
      if (!stage.pre_process) return;  // drawn after the word embeddings: nothing else moves
      // nn.Embedding draws normal(0, 1) when built; then the GPT's init redraws.
      position_embeddings = register_module(
          "position_embeddings", torch::nn::Embedding(config.seq_length, config.hidden_size));
      at::NoGradGuard no_grad;
      position_embeddings->weight.normal_(0.0, config.init_method_std);
    });
    if (split) {
      ParamAttrs a = param_attrs(word_embeddings->weight);
      a.shared_embedding = true;
      a.shared_embedding_replica = !stage.pre_process;
      set_param_attrs(word_embeddings->weight, a);
    }
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (const std::int64_t i : stage.layer_numbers)
    seeded(base, 1 + i, [&] { layers->push_back(TransformerLayer(config, st)); });
  if (stage.post_process) {
    seeded(base, 1 + config.num_layers, [&] {
      final_layernorm = register_module(
          "final_layernorm",
          torch::nn::LayerNorm(
              torch::nn::LayerNormOptions({config.hidden_size}).eps(config.layernorm_epsilon)));
    });
    if (config.sequence_parallel) mark_sequence_parallel(*final_layernorm);
  }
}

at::Tensor GPTModelImpl::forward(const at::Tensor& input, const at::Tensor& labels) {
  at::Tensor x = input;
  if (stage.pre_process) {
    const std::int64_t s = input.size(1);
    MAPP_CHECK(s <= config.seq_length, "sequence length ", s, " exceeds the model's seq_length ",
               config.seq_length);
    x = word_embeddings(input) +
        position_embeddings(at::arange(s, input.options().dtype(at::kLong)));
    x = x.transpose(0, 1).contiguous();  // [s, b, h]
    if (config.sequence_parallel) {
      MAPP_CHECK(x.size(0) % torch_ext::group_size(group_) == 0, "sequence length ", x.size(0),
                 " is not divisible by the tensor-parallel size ",
                 torch_ext::group_size(group_), " (sequence parallelism shards it)");
      x = scatter_to_sequence_parallel(x, group_);
    }
  }
  x = layers_forward(x);
  if (!stage.post_process) return x;
  x = final_layernorm(x);
  // Tied output layer: the word embeddings' shard gives this rank's vocabulary slice.
  x = config.sequence_parallel ? gather_from_sequence_parallel(x, group_)
                               : copy_to_tensor_parallel(x, group_);
  const at::Tensor logits = mapp::nn::linear(x, word_embeddings->weight);  // [s, b, V/tp]
  if (!labels.defined()) return logits.transpose(0, 1);
  return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), group_).transpose(0, 1);
}

at::Tensor GPTModelImpl::layers_forward(const at::Tensor& input) {
  const auto n = static_cast<std::int64_t>(layers->size());
  auto run = [this](std::int64_t lo, std::int64_t hi) {
    return [this, lo, hi](const at::Tensor& x) {
      at::Tensor y = x;
      for (std::int64_t i = lo; i < hi; ++i) y = (*layers)[i]->as<TransformerLayer>()->forward(y);
      return y;
    };
  };
  if (config.recompute_granularity != "full" || !is_training() || !at::GradMode::is_enabled())
    return run(0, n)(input);
  const std::int64_t k = config.recompute_num_layers;
  at::Tensor x = input;
  if (config.recompute_method == "uniform") {
    for (std::int64_t lo = 0; lo < n; lo += k)
      x = Recompute::apply(x, run(lo, std::min(n, lo + k)));
    return x;
  }
  for (std::int64_t i = 0; i < n; ++i)
    x = i < k ? Recompute::apply(x, run(i, i + 1)) : run(i, i + 1)(x);
  return x;
}

}  // namespace mapp::nn
