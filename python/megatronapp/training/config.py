"""The training configuration: one dataclass per concern, one field per flag.

Every field carries its help text, so the Megatron-style command line
(:func:`build_parser`) is generated from these classes: names, defaults and
help live in one place. A field ``tensor_model_parallel_size`` is the flag
``--tensor-model-parallel-size``; a ``bool`` field is a ``store_true`` flag.

    cfg = Config.from_args(build_parser().parse_args())
    cfg.parallel.tensor_model_parallel_size, cfg.optim.lr, ...
    plan = cfg.check(world_size)        # every check, no collective

:meth:`Config.check` runs every configuration check that needs no model and no
communication — parallel grid, batch and layer divisibility, the pipeline
schedule, sequence parallelism, the codec spec, option combinations — so a bad
command line fails identically on every rank before the first collective.
A new capability adds a section here (a dataclass and a field of
:class:`Config`) and its checks to :meth:`Config.check`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field

from ..data.tokenizers import TOKENIZER_TYPES
from ..distributed.comm import Compression
from ..pipeline import SCHEDULES, make_schedule
from ..pipeline.fbd import FBDLayout, parse_ratio, program
from ..pipeline.layout import layer_layout, parse_layout
from ..tensor_parallel.random import check_recompute
from .lr_schedule import DECAY_STYLES, WSD_STYLES, check_lr_schedule, resolve_train_iters

__all__ = ["Config", "Plan", "ConfigError", "build_parser", "SECTIONS"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which flag and why."""


def _flag(default, help: str, **argparse_kwargs):
    """A field with its help text and extra argparse options (choices, metavar)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})




@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _flag(1, "tensor-parallel size (tp)")
    pipeline_model_parallel_size: int = _flag(1, "pipeline-parallel size (pp)")
    virtual_pipeline_model_parallel_size: int | None = _flag(
        None, "model chunks per pipeline stage (interleaved / dynamic schedules)")
    pipeline_schedule: str = _flag(
        "1f1b", "1f1b becomes interleaved 1F1B with a virtual pipeline size; zb-v runs two "
        "chunks per stage in a V (stage 0 holds the first and last layers); with pp = 1 every "
        "schedule is the one-stage 1F1B", choices=SCHEDULES)
    pipeline_dynamic_policy: str = _flag("adaptive", "planner policy of --pipeline-schedule dynamic",
                                         choices=("dfc", "bfc", "auto", "adaptive"))
    pipeline_memory_limit: int | None = _flag(
        None, "dynamic schedule: live activations per stage (microbatch x chunk)", metavar="N")
    pipeline_replan_interval: int = _flag(
        20, "dynamic adaptive schedule: re-plan from measured times every N iters")
    decoder_first_pipeline_num_layers: int | None = _flag(None, "layers of the first stage")
    decoder_last_pipeline_num_layers: int | None = _flag(None, "layers of the last stage")
    pipeline_layer_layout: str | None = _flag(
        None, "layers per virtual stage (chunk-major: chunk 0 of every stage first)",
        metavar="N,N,...")
    sequence_parallel: bool = _flag(False, "shard LayerNorm/dropout activations over the "
                                    "tensor group along the sequence")
    tp_comm_overlap: bool = _flag(
        False, "hide the tensor-parallel all-gathers and reduce-scatters of sequence "
        "parallelism behind the linears' GEMMs (pipelined pieces on the tensor group's "
        "communication thread; docs/architecture.md); needs --sequence-parallel")
    disable_tp_comm_overlap_ag: bool = _flag(
        False, "--tp-comm-overlap: no pipelined all-gather + GEMM (column forward, row backward)")
    disable_tp_comm_overlap_rs: bool = _flag(
        False, "--tp-comm-overlap: no pipelined GEMM + reduce-scatter (row forward)")
    tp_comm_overlap_rs_dgrad: bool = _flag(
        False, "--tp-comm-overlap: pipeline the column linear's input-gradient GEMM with its "
        "reduce-scatter (instead of running that reduce-scatter behind the weight gradient)")
    disable_tp_comm_bulk_dgrad: bool = _flag(
        False, "--tp-comm-overlap: no input all-gather behind the input-gradient GEMM")
    disable_tp_comm_bulk_wgrad: bool = _flag(
        False, "--tp-comm-overlap: no input-gradient reduce-scatter behind the weight-gradient "
        "GEMM")
    tp_comm_overlap_splits: int = _flag(
        4, "--tp-comm-overlap: pieces a pipelined GEMM is cut into (the largest divisor of the "
        "local sequence length not above it)")
    scatter_gather_tensors_in_pipeline: bool = _flag(
        False, "without sequence parallelism, each tensor rank sends 1/tp of every tensor "
        "between pipeline stages and the receivers all-gather (fewer bytes on a slow "
        "pipeline link; off by default: no gain measured within a node)")
    context_parallel_size: int = _flag(
        1, "split every sequence over this many ranks (cp; zigzag chunks, causal balance)")
    cp_comm_type: str = _flag("p2p", "context-parallel attention: p2p (ring exchange of K/V) "
                              "or a2a (all-to-all to head shards, DeepSpeed-Ulysses)",
                              choices=("p2p", "a2a"))
    distributed_backend: str = _flag(
        "auto", "auto: nccl with CUDA, gloo otherwise (whose groups move this node's "
        "collectives through shared memory all the same); mapp: the shared-memory backend for "
        "every group (megatronapp.distributed.backend)", choices=("auto", "gloo", "nccl", "mapp"))
    forward_backward_disaggregating: bool = _flag(
        False, "MegaFBD: split the data-parallel ranks into forward-only ranks, which run "
        "the pipeline without autograd and ship each stage's input, and backward ranks, which "
        "recompute that stage and run its backward (docs/fbd.md); needs pp >= 2")
    fbd_ratio: str = _flag("1:1", "forward:backward ranks per FBD group (1:1, 1:2, 2:1, ...); "
                           "the data-parallel size must be a multiple of their sum",
                           metavar="F:B")


    def tp_overlap(self):
        """The :class:`~megatronapp.tensor_parallel.TPCommOverlap` of
        ``--tp-comm-overlap``, or None without it."""
        if not self.tp_comm_overlap:
            return None
        from ..tensor_parallel.overlap import TPCommOverlap

        return TPCommOverlap(ag=not self.disable_tp_comm_overlap_ag,
                             rs=not self.disable_tp_comm_overlap_rs,
                             rs_dgrad=self.tp_comm_overlap_rs_dgrad,
                             bulk_dgrad=not self.disable_tp_comm_bulk_dgrad,
                             bulk_wgrad=not self.disable_tp_comm_bulk_wgrad,
                             splits=self.tp_comm_overlap_splits)


@dataclass
class DataParallelConfig:
    use_distributed_optimizer: bool = _flag(
        False, "ZeRO-1: shard optimizer state over data-parallel ranks")
    grad_compression: str = _flag(
        "none", "none, bf16, fp16, int8[:block], onebit[:block], topk:<ratio>, powersgd:<rank>",
        metavar="SPEC")
    grad_compression_start_iter: int = _flag(0, "run uncompressed for the first N iterations")
    bucket_size_mb: float = _flag(25.0, "gradient bucket size")
    no_overlap_grad_reduce: bool = _flag(
        False, "reduce gradients at the end of backward instead of during it")
    no_gradient_accumulation_fusion: bool = _flag(
        False, "compute each weight gradient into a temporary that autograd then adds to the "
        "gradient buffer, instead of adding it into the buffer in the GEMM itself (beta = 1)")
    overlap_param_gather: bool = _flag(
        False, "ZeRO-1: all-gather the updated parameters in the background, each module "
        "waiting for its own just before its next forward (needs --use-distributed-optimizer)")


@dataclass
class PrecisionConfig:
    bf16: bool = _flag(False, "bfloat16 parameters and activations; fp32 main gradients and "
                       "master weights in the optimizer")
    fp16: bool = _flag(False, "float16 parameters and activations with dynamic loss scaling; "
                       "fp32 main gradients and master weights")
    accumulate_allreduce_grads_in_fp32: bool = _flag(
        False, "accumulate and reduce gradients in fp32 (always on with --bf16/--fp16 here: "
        "the gradient codecs and the optimizers read fp32 main gradients)")
    loss_scale: float | None = _flag(None, "fp16: a constant loss scale instead of the dynamic "
                                     "one")
    initial_loss_scale: float = _flag(2.0**32, "fp16: initial dynamic loss scale")
    min_loss_scale: float = _flag(1.0, "fp16: the dynamic loss scale never goes below this")
    loss_scale_window: int = _flag(1000, "fp16: overflow-free steps before the scale doubles")
    hysteresis: int = _flag(2, "fp16: overflows tolerated before the scale halves")
    fp8_format: str | None = _flag(
        None, "FP8 GEMMs in the tensor-parallel linears (megatronapp.fp8, emulated: FP8 "
        "operands with per-tensor scales, fp32 accumulation): e4m3 everywhere, or hybrid "
        "(E4M3 forward, E5M2 output gradients)", choices=("e4m3", "hybrid"))
    fp8_recipe: str = _flag(
        "delayed", "FP8 scaling: delayed (from the amax history of past iterations, agreed "
        "over the ranks holding the same layers) or tensorwise (each tensor's own amax, now)",
        choices=("delayed", "tensorwise"))
    fp8_amax_history_len: int = _flag(1, "FP8 delayed scaling: iterations of amax history")
    fp8_amax_compute_algo: str = _flag(
        "most_recent", "FP8 delayed scaling: the history's most recent amax or its max",
        choices=("most_recent", "max"))
    fp8_margin: int = _flag(0, "FP8: scales are divided by 2^margin (headroom)")

    def fp8(self):
        """The :class:`megatronapp.fp8.FP8Recipe` of the flags, or None."""
        if self.fp8_format is None:
            return None
        from ..fp8 import FP8Recipe

        return FP8Recipe(self.fp8_format, self.fp8_recipe, self.fp8_amax_history_len,
                         self.fp8_amax_compute_algo, self.fp8_margin)

    def dtype(self):
        import torch

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass
class ModelConfig:
    num_layers: int = _flag(4, "transformer layers")
    hidden_size: int = _flag(128, "hidden size")
    num_attention_heads: int = _flag(4, "attention heads")
    ffn_hidden_size: int | None = _flag(None, "MLP hidden size (default 4 x hidden)")
    seq_length: int = _flag(128, "tokens per sample")
    make_vocab_size_divisible_by: int = _flag(128, "pad the vocabulary to a multiple of this x tp")
    untie_embeddings_and_output_weights: bool = _flag(
        False, "separate output layer instead of the word embeddings")
    hidden_dropout: float = _flag(
        0.0, "dropout after the embeddings, attention and MLP (Megatron's default is 0.1)")
    attention_dropout: float = _flag(
        0.0, "dropout on the attention probabilities (Megatron's default is 0.1)")
    attention_backend: str = _flag(
        "auto", "core attention: auto/flash/fused use torch's fused scaled_dot_product_attention; "
        "unfused/local compute scores, softmax and dropout as separate ops (Megatron's local "
        "attention, what selective recomputation saves most on)",
        choices=("auto", "flash", "fused", "unfused", "local"))
    # ---- the block: Megatron-LM's flags (defaults: the GPT-2 block) ----
    normalization: str = _flag("LayerNorm", "LayerNorm or RMSNorm (Llama, Qwen, Mixtral)",
                               choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = _flag(1e-5, "epsilon of every LayerNorm / RMSNorm")
    swiglu: bool = _flag(False, "gated MLP silu(x W_gate) * (x W_up) (experts too); with "
                         "--ffn-hidden-size the width of each of the two")
    position_embedding_type: str = _flag(
        "learned_absolute", "learned_absolute (GPT-2), rope (rotary, on queries and keys), yarn "
        "(RoPE with YaRN's context extension, DeepSeek-V3) or none",
        choices=("learned_absolute", "rope", "none", "yarn"))
    rotary_base: int = _flag(10000, "RoPE base (Llama-3: 500000, Qwen2: 1000000)")
    rotary_percent: float = _flag(1.0, "fraction of each head's channels RoPE rotates")
    rotary_interleaved: bool = _flag(False, "RoPE on channel pairs (2i, 2i+1) instead of "
                                     "(i, i + d/2)")
    use_rope_scaling: bool = _flag(False, "Llama-3.1's RoPE frequency scaling")
    rope_scaling_factor: float = _flag(8.0, "factor of --use-rope-scaling")
    rope_scaling_low_freq_factor: float = _flag(1.0, "--use-rope-scaling: low-frequency factor")
    rope_scaling_high_freq_factor: float = _flag(4.0, "--use-rope-scaling: high-frequency factor")
    rope_scaling_original_max_position: int = _flag(
        8192, "--use-rope-scaling: the context length the model was pretrained with")
    group_query_attention: bool = _flag(False, "grouped-query attention (--num-query-groups)")
    num_query_groups: int = _flag(1, "key/value heads with --group-query-attention")
    kv_channels: int | None = _flag(None, "channels per attention head (default hidden / "
                                    "heads)", metavar="N")
    disable_bias_linear: bool = _flag(False, "no biases in the attention and MLP linears")
    add_qkv_bias: bool = _flag(False, "a QKV bias even with --disable-bias-linear (Qwen2)")
    qk_layernorm: bool = _flag(False, "normalize each query and key head (Qwen3)")
    yarn_rotary_scaling_factor: float = _flag(1.0, "YaRN: context extension factor (DeepSeek-V3: 40)")
    yarn_original_max_position_embeddings: int = _flag(
        4096, "YaRN: the context length the base model was trained with")
    yarn_beta_fast: float = _flag(32.0, "YaRN: dimensions turning more often over the original "
                                  "context keep their frequency")
    yarn_beta_slow: float = _flag(1.0, "YaRN: dimensions turning less often are fully interpolated")
    yarn_mscale: float = _flag(1.0, "YaRN: attention temperature numerator (0.1 m ln factor + 1)")
    yarn_mscale_all_dim: float = _flag(0.0, "YaRN: its denominator; with MLA the softmax scale is "
                                       "also multiplied by its square")
    multi_latent_attention: bool = _flag(False, "multi-latent attention (DeepSeek-V2/V3): keys and "
                                         "values from one compressed latent per token")
    q_lora_rank: int | None = _flag(None, "MLA: rank of the query compression (None: queries "
                                    "straight from the hidden states)", metavar="N")
    kv_lora_rank: int = _flag(32, "MLA: rank of the key/value latent")
    qk_head_dim: int = _flag(128, "MLA: per-head query/key channels without position")
    qk_pos_emb_head_dim: int = _flag(64, "MLA: per-head rotary channels (one rotary key shared "
                                     "by every head)")
    v_head_dim: int = _flag(128, "MLA: per-head value channels")
    mtp_num_layers: int | None = _flag(None, "multi-token prediction: depths on the last stage, "
                                       "each predicting one token further (DeepSeek-V3: 1)",
                                       metavar="N")
    mtp_loss_scaling_factor: float = _flag(0.1, "multi-token prediction: the weight of the mean "
                                           "of the MTP losses in the trained loss")

    def block_kwargs(self) -> dict:
        """The GPTConfig fields of the block flags."""
        return dict(
            normalization=self.normalization, layernorm_epsilon=self.norm_epsilon,
            swiglu=self.swiglu, position_embedding_type=self.position_embedding_type,
            rotary_base=float(self.rotary_base), rotary_percent=self.rotary_percent,
            rotary_interleaved=self.rotary_interleaved, use_rope_scaling=self.use_rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
            rope_scaling_low_freq_factor=self.rope_scaling_low_freq_factor,
            rope_scaling_high_freq_factor=self.rope_scaling_high_freq_factor,
            rope_scaling_original_max_position=self.rope_scaling_original_max_position,
            num_query_groups=self.num_query_groups if self.group_query_attention else None,
            kv_channels=self.kv_channels, add_bias_linear=not self.disable_bias_linear,
            add_qkv_bias=self.add_qkv_bias, qk_layernorm=self.qk_layernorm,
            mtp_loss_scaling_factor=self.mtp_loss_scaling_factor,
            **{k: getattr(self, k) for k in MLA_YARN_FIELDS})


#: the YaRN and multi-latent attention fields (the same name as flag and GPTConfig field)
MLA_YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
                   "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
                   "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                   "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers")


#: model flags a checkpoint fixes: {flag field: (GPTConfig field, GPTConfig
#: value -> flag value)}; `--load` adopts them unless given, and a given flag
#: that disagrees is an error naming both values
ARCHITECTURE_FLAGS = {
    "num_layers": ("num_layers", None), "hidden_size": ("hidden_size", None),
    "num_attention_heads": ("num_attention_heads", None),
    "ffn_hidden_size": ("ffn_hidden_size", None),
    "untie_embeddings_and_output_weights": ("share_embeddings_and_output_weights",
                                            lambda v: not v),
    "normalization": ("normalization", None), "norm_epsilon": ("layernorm_epsilon", None),
    "swiglu": ("swiglu", None), "position_embedding_type": ("position_embedding_type", None),
    "rotary_base": ("rotary_base", lambda v: int(v) if float(v).is_integer() else v),
    "rotary_percent": ("rotary_percent", None), "rotary_interleaved": ("rotary_interleaved", None),
    "use_rope_scaling": ("use_rope_scaling", None),
    "rope_scaling_factor": ("rope_scaling_factor", None),
    "rope_scaling_low_freq_factor": ("rope_scaling_low_freq_factor", None),
    "rope_scaling_high_freq_factor": ("rope_scaling_high_freq_factor", None),
    "rope_scaling_original_max_position": ("rope_scaling_original_max_position", None),
    "kv_channels": ("kv_channels", None),
    "disable_bias_linear": ("add_bias_linear", lambda v: not v),
    "add_qkv_bias": ("add_qkv_bias", None), "qk_layernorm": ("qk_layernorm", None),
    "num_experts": ("num_experts", None), "moe_ffn_hidden_size": ("moe_ffn_hidden_size", None),
    "moe_layer_freq": ("moe_layer_freq", lambda v: str(v).replace(" ", "")),
    "moe_router_topk": ("moe_router_topk", None),
    "moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size", None),
    "moe_router_topk_scaling_factor": ("moe_router_topk_scaling_factor", None),
    **{k: (k, None) for k in MLA_YARN_FIELDS},
}


@dataclass
class MoEConfig:
    num_experts: int | None = _flag(None, "mixture of experts: experts per MoE layer "
                                    "(default: dense MLPs)")
    expert_model_parallel_size: int = _flag(1, "ranks the experts are sharded over (ep), "
                                            "carved out of the data-parallel ranks (and the "
                                            "tensor ranks beyond --expert-tensor-parallel-size)")
    expert_tensor_parallel_size: int | None = _flag(
        None, "ranks each expert's weights are split over (default: the tensor-parallel size; "
        "must divide it). DeepSeek-V3 in Megatron: 1, the tensor ranks then route their own "
        "slices of the tokens and join the expert grid", metavar="ETP")
    moe_layer_freq: str = _flag("1", "N: every N-th layer is MoE; or a 0/1 list per layer, "
                                "e.g. [0,1,0,1]", metavar="N|LIST")
    moe_ffn_hidden_size: int | None = _flag(None, "expert MLP hidden size (default "
                                            "--ffn-hidden-size)")
    moe_router_topk: int = _flag(2, "experts per token")
    moe_router_score_function: str = _flag("softmax", "sigmoid: DeepSeek-V3's scores",
                                           choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = _flag(False, "softmax over all experts before the top-k")
    moe_router_load_balancing_type: str = _flag(
        "aux_loss", "load-balancing loss: over the micro-batch (aux_loss) or within each "
        "sequence (seq_aux_loss, DeepSeek-V3's)", choices=("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = _flag(0.0, "weight of the load-balancing loss (e.g. 1e-2)")
    moe_z_loss_coeff: float | None = _flag(None, "weight of the router z-loss (e.g. 1e-3)")
    moe_router_enable_expert_bias: bool = _flag(
        False, "auxiliary-loss-free balancing: a per-expert selection bias nudged after every "
        "step (DeepSeek-V3; use with --moe-router-score-function sigmoid)")
    moe_router_bias_update_rate: float = _flag(1e-3, "step of the expert bias update")
    moe_expert_capacity_factor: float | None = _flag(
        None, "an expert takes at most factor x tokens x topk / experts tokens; the rest are "
        "dropped (default: dropless)")
    moe_pad_expert_input_to_capacity: bool = _flag(
        False, "pad every expert's input to its capacity (static shapes)")
    moe_token_drop_policy: str = _flag("probs", "which tokens an over-full expert keeps",
                                       choices=("probs", "position"))
    moe_token_dispatcher_type: str = _flag("alltoall", "token dispatcher",
                                           choices=("alltoall",))
    moe_dispatch_compression: str = _flag(
        "none", "send dispatched tokens as int8[:block] (block-scaled, ~1/4 of the fp32 bytes) "
        "or bf16/fp16; the combine stays in full precision", metavar="SPEC")
    moe_shared_expert_intermediate_size: int | None = _flag(
        None, "shared experts: a dense MLP of this width every MoE layer adds to its routed "
        "experts (DeepSeek, Qwen-MoE)", metavar="N")
    moe_router_topk_scaling_factor: float | None = _flag(
        None, "multiply the top-k routing weights by this (DeepSeek-V3: 2.5)", metavar="F")
    moe_router_num_groups: int | None = _flag(
        None, "group-limited routing: the experts form this many equal groups (DeepSeek-V3: 8, "
        "one per node)", metavar="G")
    moe_router_group_topk: int | None = _flag(
        None, "group-limited routing: groups a token may reach (DeepSeek-V3: 4)", metavar="N")

    def layer_freq(self):
        """--moe-layer-freq as an int or a list of 0/1; Megatron's list
        expressions such as ``([0]*3+[1]*58)`` (lists of ints, ``*`` by an int,
        ``+``) are evaluated without eval."""
        try:
            v = _int_list_expr(str(self.moe_layer_freq))
        except (ValueError, SyntaxError):
            raise ConfigError(f"--moe-layer-freq {self.moe_layer_freq!r}: expected an int or a "
                              "list like [0,1,0,1] or ([0]*3+[1]*58)") from None
        return list(v) if isinstance(v, (list, tuple)) else v


def _int_list_expr(text: str):
    """An int, or a list of ints built from list literals, ``list * int`` and
    ``list + list`` (what --moe-layer-freq accepts); ValueError otherwise."""
    import ast

    def walk(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(
                n.value, bool):
            return n.value
        if isinstance(n, (ast.List, ast.Tuple)):
            out = [walk(e) for e in n.elts]
            if not all(isinstance(e, int) for e in out):
                raise ValueError("nested list")
            return out
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Mult)):
            a, b = walk(n.left), walk(n.right)
            if isinstance(n.op, ast.Add) and isinstance(a, list) and isinstance(b, list):
                return a + b
            if isinstance(n.op, ast.Mult) and isinstance(a, list) and isinstance(b, int) \
                    and 0 <= b <= 1 << 20:
                return a * b
            if isinstance(n.op, ast.Mult) and isinstance(b, list) and isinstance(a, int) \
                    and 0 <= a <= 1 << 20:
                return b * a
        raise ValueError(f"unsupported expression {ast.dump(n)}")
    return walk(ast.parse(text.strip(), mode="eval").body)


@dataclass
class RecomputeConfig:
    recompute_activations: bool = _flag(
        False, "shorthand for --recompute-granularity selective")
    recompute_granularity: str | None = _flag(
        None, "selective: recompute core attention in backward; full: recompute whole layers "
        "(with --recompute-method and --recompute-num-layers); auto: the least recomputation "
        "the memory planner finds fits --memory-limit-gb",
        choices=("selective", "full", "auto"))
    recompute_method: str | None = _flag(
        None, "full: uniform recomputes groups of --recompute-num-layers layers from their "
        "input; block recomputes the first --recompute-num-layers layers of each stage",
        choices=("uniform", "block"))
    recompute_num_layers: int | None = _flag(
        None, "full: layers per group (uniform) or recomputed layers per stage (block)",
        metavar="N")
    distribute_saved_activations: bool = _flag(
        False, "full: keep 1/tp of each recomputed group's input per tensor rank "
        "(not with --sequence-parallel)")

    def granularity(self) -> str | None:
        """--recompute-granularity, with --recompute-activations meaning selective."""
        if self.recompute_activations and self.recompute_granularity is None:
            return "selective"
        return self.recompute_granularity


@dataclass
class OptimConfig:
    micro_batch_size: int = _flag(4, "samples per microbatch")
    global_batch_size: int = _flag(16, "samples per iteration over all data-parallel ranks")
    lr: float = _flag(3e-3, "peak learning rate")
    min_lr: float = _flag(3e-4, "learning rate at the end of the decay")
    lr_warmup_iters: int = _flag(10, "linear warm-up iterations")
    lr_decay_style: str = _flag(
        "cosine", "after the warm-up (megatronapp.training.lr_schedule): constant, linear or "
        "cosine to --min-lr, inverse-square-root, or WSD (warm-up, stable, then an anneal "
        "over the last --lr-wsd-decay-iters)", choices=DECAY_STYLES)
    lr_decay_iters: int | None = _flag(
        None, "iterations of the decay, counted from the start (default: --train-iters); "
        "--min-lr after them", metavar="N")
    lr_warmup_fraction: float | None = _flag(
        None, "warm-up as a fraction of the decay (instead of --lr-warmup-iters/-samples)",
        metavar="F")
    lr_warmup_init: float = _flag(0.0, "the learning rate the warm-up starts from")
    lr_wsd_decay_style: str = _flag(
        "exponential", "the shape of WSD's final anneal", choices=WSD_STYLES)
    lr_wsd_decay_iters: int | None = _flag(
        None, "WSD: iterations of the final anneal (the end of the decay)", metavar="N")
    train_samples: int | None = _flag(
        None, "count the run in samples instead of --train-iters: train_samples // "
        "--global-batch-size iterations, and the schedule in samples", metavar="N")
    lr_decay_samples: int | None = _flag(
        None, "--train-samples: samples of the decay (default: --train-samples)", metavar="N")
    lr_warmup_samples: int | None = _flag(
        None, "--train-samples: samples of the linear warm-up (default 0)", metavar="N")
    lr_wsd_decay_samples: int | None = _flag(
        None, "--train-samples, WSD: samples of the final anneal", metavar="N")
    weight_decay: float = _flag(0.01, "weight decay (matrices only; AdamW's decoupled, SGD's "
                                "added to the gradient)")
    optimizer: str = _flag(
        "adam", "adam: AdamW (decoupled weight decay, as Megatron-LM's adam); sgd: SGD with "
        "--sgd-momentum; both under ZeRO-1, mixed precision and checkpoints; muon: "
        "orthogonalized momentum for the linear layers' matrices, AdamW for the rest "
        "(megatronapp.optimizer.muon)", choices=("adam", "sgd", "muon"))
    adam_beta1: float = _flag(0.9, "AdamW's first-moment decay")
    adam_beta2: float = _flag(
        0.95, "AdamW's second-moment decay (Megatron-LM's default is 0.999; 0.95 is the "
        "usual LLM setting and this runtime's default since its first release)")
    adam_eps: float = _flag(1e-8, "AdamW's denominator term")
    sgd_momentum: float = _flag(0.9, "SGD's momentum (0: none)")
    muon_momentum: float = _flag(0.95, "Muon's momentum (an EMA of the gradients)")
    muon_nesterov: bool = _flag(False, "Muon: Nesterov-style momentum")
    muon_num_ns_steps: int = _flag(5, "Muon: Newton-Schulz iterations")
    muon_scale_mode: str = _flag(
        "spectral", "Muon's update scale from the matrix shape: spectral sqrt(max(out, in)), "
        "shape_scaling sqrt(max(1, out/in)), unit_rms_norm sqrt(out/in)",
        choices=("spectral", "shape_scaling", "unit_rms_norm"))
    muon_extra_scale_factor: float = _flag(1.0, "Muon: a further factor on the update")
    muon_tp_mode: str = _flag(
        "blockwise", "Muon under tensor parallelism: blockwise (each shard on its own) or "
        "duplicated (the whole matrix gathered: one rank's update)",
        choices=("blockwise", "duplicated"))
    no_muon_split_qkv: bool = _flag(
        False, "Muon: orthogonalize the fused QKV weight whole (default: queries, key and "
        "value of each query group apart, as Megatron-LM's --muon-split-qkv)")
    optimizer_impl: str = _flag(
        "torch", "AdamW's implementation: torch (torch.optim.AdamW, its per-tensor loop) or "
        "fused (megatronapp.optimizer.FusedAdamW: one C++ pass over each tensor, AVX2 on CPU, "
        "a multi-tensor CUDA kernel; same update and checkpoint keys)",
        choices=("torch", "fused"))
    clip_grad: float = _flag(1.0, "clip the global gradient norm to this (0: off)")
    train_iters: int = _flag(100, "training iterations")
    eval_iters: int = _flag(4, "validation batches per evaluation")
    eval_interval: int = _flag(
        0, "also evaluate every N iterations (0: only at the end); the loss curve records "
        "validation loss and training-only wall time at each", metavar="N")
    seed: int = _flag(1234, "seed of weights and data order (same on every rank)")
    calculate_per_token_loss: bool = _flag(
        False, "the loss is the mean over every unmasked token of the global batch (not the "
        "mean of the microbatches' means): exact under --eod-mask-loss, DP and CP")
    manual_gc: bool = _flag(
        False, "turn Python's automatic garbage collector off for the run: its full "
        "collections stall one rank at a time while its peers wait. Collects after setup "
        "(and freezes what lives then out of the collector's sight, unless the process froze "
        "objects itself), every --manual-gc-interval iterations and around evaluations; the "
        "collector is restored at the end")
    manual_gc_interval: int = _flag(
        0, "--manual-gc: collect every N iterations (0: only after setup and around "
        "evaluations)", metavar="N")
    no_manual_gc_eval: bool = _flag(False, "--manual-gc: no collection around evaluations")


@dataclass
class DataConfig:
    data_path: str | None = _flag(
        None, "a Megatron indexed dataset prefix (PREFIX.bin/.idx, from python -m "
        "megatronapp.data.preprocess), weighted prefixes 'W1 P1 W2 P2 ...', or one plain text "
        "file (tokenized in memory); default: the bundled KJV excerpt", nargs="+",
        metavar="PATH")
    split: str = _flag("969,30,1", "train,valid,test weights of each indexed dataset's documents")
    data_cache_path: str | None = _flag(
        None, "where the sample indices are cached (default: PREFIX's directory/cache)",
        metavar="DIR")
    tokenizer_type: str = _flag("ByteTokenizer", "tokenizer of plain-text --data-path "
                                "(indexed datasets were tokenized by preprocess)",
                                choices=TOKENIZER_TYPES)
    vocab_file: str | None = _flag(None, "GPT2BPETokenizer: vocab.json", metavar="FILE")
    merge_file: str | None = _flag(None, "GPT2BPETokenizer: merges.txt", metavar="FILE")
    tokenizer_model: str | None = _flag(
        None, "SentencePiece .model or Hugging Face tokenizer.json", metavar="FILE")
    vocab_size: int | None = _flag(None, "NullTokenizer: number of token ids", metavar="N")
    reset_position_ids: bool = _flag(
        False, "packed documents: positions restart at 0 after each end-of-document token")
    reset_attention_mask: bool = _flag(
        False, "packed documents: attention stays within each document (also under context "
        "parallelism)")
    eod_mask_loss: bool = _flag(
        False, "no loss where the input is an end-of-document token (predicting the next "
        "document's first token)")

    def paths(self) -> list[str] | None:
        """--data-path as a list (a Config built in Python may hold one string)."""
        p = self.data_path
        return [p] if isinstance(p, str) else (list(p) if p else None)

    def is_indexed(self) -> bool:
        """Whether --data-path names indexed datasets (else one text file / the default)."""
        from ..data.indexed import exists

        p = self.paths()
        if not p:
            return False
        return not (len(p) == 1 and os.path.isfile(p[0]) and not exists(p[0]))

    def tokenizer_kwargs(self) -> dict:
        return dict(tokenizer_type=self.tokenizer_type, vocab_file=self.vocab_file,
                    merge_file=self.merge_file, tokenizer_model=self.tokenizer_model,
                    vocab_size=self.vocab_size)


@dataclass
class LoggingConfig:
    log_interval: int = _flag(10, "log line every N iterations (with --no-progress)")
    output_dir: str = _flag("runs/gpt", "loss curve CSV/PNG and summary")
    no_progress: bool = _flag(False, "plain log lines instead of a bar")
    tensorboard_dir: str | None = _flag(
        None, "write TensorBoard scalars (loss, lr, grad norm, tokens/s, memory) here",
        metavar="DIR")
    wandb_project: str | None = _flag(
        None, "log the scalars to Weights & Biases under this project (pip install wandb; "
        "WANDB_MODE=offline needs no network)", metavar="P")
    wandb_exp_name: str | None = _flag(None, "the W&B run's name", metavar="NAME")
    wandb_save_dir: str | None = _flag(
        None, "where W&B writes its files (default: OUTPUT_DIR/wandb)", metavar="DIR")
    wandb_entity: str | None = _flag(None, "the W&B team or user", metavar="E")
    peak_tflops: float | None = _flag(
        None, "the rank's peak dense TFLOP/s, for MFU in the logs (default: the GPU's BF16 "
        "peak: H100/H200 989, B200 2250; none on a CPU, where only TFLOP/s is shown)",
        metavar="T")
    scope_port: int | None = _flag(
        None, "serve MegaScope on this port from rank 0 while training (0: any free port, "
        "written to OUTPUT_DIR/scope.port); docs/scope.md", metavar="P")
    scope_host: str = _flag("127.0.0.1", "MegaScope's address (not loopback: --scope-token)")
    scope_token: str | None = _flag(None, "token MegaScope clients must send", metavar="T")


@dataclass
class CheckpointConfig:
    save: str | None = _flag(None, "save checkpoints here", metavar="DIR")
    save_interval: int | None = _flag(None, "save every N iterations (and at the end)",
                                      metavar="N")
    async_save: bool = _flag(
        False, "copy the state to host memory and write the checkpoint in the background")
    load: str | None = _flag(None, "resume from DIR/latest (any tp/pp/dp layout)", metavar="DIR")
    watchdog_timeout: float = _flag(
        30.0, "declare a rank dead after S seconds without heartbeat; exit non-zero",
        metavar="S")
    no_watchdog: bool = _flag(False, "no dead-rank watchdog")
    override_opt_param_scheduler: bool = _flag(
        False, "--load: run this command line's learning-rate schedule where it differs from "
        "the checkpoint's without the warning naming the differences (Megatron-LM stops "
        "without this flag; here the command line's schedule always runs)",
        aliases=("--override-opt_param-scheduler",))


@dataclass
class TraceConfig:
    trace: bool = _flag(False, "record a Chrome trace per rank "
                        "(python -m megatronapp.trace aggregate)")
    trace_dir: str = _flag("runs/trace", "per-rank trace files")
    trace_interval: int = _flag(1, "trace --trace-iterations of every N iterations", metavar="N")
    trace_iterations: int | None = _flag(None, "traced iterations per interval", metavar="K")
    trace_granularity: str = _flag("full", "coarse drops per-microbatch compute and P2P events",
                                   choices=("full", "coarse"))
    trace_detect_interval: int = _flag(
        0, "online slow-rank detection every N traced iterations (0: off)", metavar="N")


@dataclass
class MemoryConfig:
    memory_pool: bool = _flag(
        False, "serve tensor memory from megatronapp's caching pool; prints its summary")
    memory_pool_policy: str = _flag("ours", "allocation policy of the pool",
                                    choices=("ours", "torch-like"))
    memory_limit_gb: float | None = _flag(
        None, "memory per rank in GiB: the planner (python -m megatronapp.memory estimate) "
        "checks the run fits before it starts, picks --recompute-granularity auto's "
        "recomputation and the dynamic schedule's live-activation limit", metavar="X")
    record_alloc_trace: str | None = _flag(
        None, "record the CPU pool's allocation trace ('{rank}' in FILE is replaced; "
        "otherwise .rankN is appended when there are several ranks)", metavar="FILE")


#: (attribute of Config, argparse group title, dataclass), in --help order.
@dataclass
class VisionConfig:
    """Vision models (examples/pretrain_vit.py, examples/pretrain_vlm.py); ignored by the GPT."""

    img_h: int = _flag(16, "image height in pixels")
    img_w: int = _flag(16, "image width in pixels")
    patch_dim: int = _flag(4, "patch size (a square patch_dim x patch_dim)")
    num_channels: int = _flag(3, "image channels")
    num_classes: int | None = _flag(
        None, "classification classes (default: the dataset's; the shapes set has 12)")
    encoder_num_layers: int | None = _flag(
        None, "VLM: transformer layers of the vision encoder (default: --num-layers)")
    disable_vision_class_token: bool = _flag(
        False, "VLM: drop the encoder's class token (the image is the patch embeddings only)")


SECTIONS = (
    ("parallel", "parallelism", ParallelConfig),
    ("data_parallel", "data parallelism", DataParallelConfig),
    ("model", "model", ModelConfig),
    ("moe", "mixture of experts", MoEConfig),
    ("precision", "mixed precision", PrecisionConfig),
    ("recompute", "activation recomputation", RecomputeConfig),
    ("optim", "training", OptimConfig),
    ("data", "data", DataConfig),
    ("logging", "logging and output", LoggingConfig),
    ("checkpoint", "checkpointing and fault tolerance", CheckpointConfig),
    ("trace", "tracing", TraceConfig),
    ("memory", "memory", MemoryConfig),
    ("vision", "vision models", VisionConfig),
)


@dataclass(frozen=True)
class Plan:
    """What :meth:`Config.check` derived: the grid and the work split."""

    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int
    microbatches: int  #: per data-parallel rank and iteration
    layer_layout: list  #: layers per virtual pipeline stage
    placement: str = "loop"  #: of the chunks: "loop" (interleaved) or "wave" (zb-v)


@dataclass
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    #: the flags a command line gave (None: built in Python, every field counts as given)
    explicit: frozenset | None = field(default=None, repr=False, compare=False)
    #: --load: the vocabulary rows of the checkpoint's embedding (set by the GPT task)
    checkpoint_vocab_size: int | None = field(default=None, repr=False, compare=False)

    # ---- conversions ---------------------------------------------------------------
    @classmethod
    def from_args(cls, args) -> Config:
        """From a flat namespace (argparse, or any object with the flag names as
        attributes); an existing Config is returned as is."""
        if isinstance(args, Config):
            return args
        values = vars(args)
        sections = {}
        for attr, _title, section in SECTIONS:
            sections[attr] = section(**{f.name: values[f.name]
                                        for f in dataclasses.fields(section) if f.name in values})
        return cls(**sections, explicit=values.get("mapp_explicit_flags"))

    def _effective(self, flag: str):
        """A model flag's value with its default resolved (ffn 4 x hidden, ...)."""
        m = self.model
        if flag == "ffn_hidden_size" and m.ffn_hidden_size is None:
            return 4 * m.hidden_size
        if flag == "kv_channels" and m.kv_channels is None:
            return m.hidden_size // m.num_attention_heads
        if flag == "moe_ffn_hidden_size" and self.moe.moe_ffn_hidden_size is None:
            return self._effective("ffn_hidden_size")
        if flag == "moe_layer_freq":  # evaluated: "([0]*1+[1]*3)" is "[0,1,1,1]"
            return str(self.moe.layer_freq()).replace(" ", "")
        return getattr(m if hasattr(m, flag) else self.moe, flag)

    def adopt_checkpoint_architecture(self, saved: dict, where: str) -> list[str]:
        """Takes the architecture a checkpoint's model config `saved` fixes
        (:data:`ARCHITECTURE_FLAGS`) for every flag the command line did not
        give; a given flag that disagrees is a :class:`ConfigError` naming
        both values. Returns the adopted flags ("--flag value")."""
        sections = {f.name: attr for attr, _t, sec in SECTIONS for f in dataclasses.fields(sec)}
        adopted, conflicts = [], []
        rope = saved.get("position_embedding_type", "learned_absolute") != "learned_absolute"
        pairs = dict(ARCHITECTURE_FLAGS)
        if not rope:  # a learned position table fixes the sequence length
            pairs["seq_length"] = ("seq_length", None)
        for flag, (key, conv) in pairs.items():
            if key not in saved:
                continue
            want = saved[key] if conv is None else conv(saved[key])
            if flag.startswith("moe_") and saved.get("num_experts") is None:
                continue
            section = getattr(self, sections[flag])
            have = self._effective(flag)
            if self.explicit is None or flag in self.explicit:
                if have != want:
                    conflicts.append(f"--{flag.replace('_', '-')} {have} here, {want} in the "
                                     "checkpoint")
            elif have != want:
                setattr(section, flag, want)
                adopted.append(f"--{flag.replace('_', '-')}" + (
                    "" if want is True else f" {want}"))
        ng = saved.get("num_query_groups")
        if ng is not None and ng != saved.get("num_attention_heads"):
            given = self.explicit is None or "num_query_groups" in self.explicit or \
                "group_query_attention" in self.explicit
            m = self.model
            if given and (not m.group_query_attention or m.num_query_groups != ng):
                have = m.num_query_groups if m.group_query_attention else "off"
                conflicts.append(f"--num-query-groups {have} here, {ng} in the checkpoint")
            elif not given:
                m.group_query_attention, m.num_query_groups = True, ng
                adopted.append(f"--group-query-attention --num-query-groups {ng}")
        if conflicts:
            raise ConfigError(f"--load {where}: the checkpoint's architecture disagrees with "
                              "the command line: " + "; ".join(conflicts)
                              + " (drop those flags: the checkpoint's are used)")
        return adopted

    def flat(self) -> dict:
        """{flag name with underscores: value} of every field."""
        return {k: v for attr, _t, _s in SECTIONS
                for k, v in dataclasses.asdict(getattr(self, attr)).items()}

    # ---- the checks ------------------------------------------------------------------
    def packing(self) -> bool:
        """Whether a microbatch carries its documents (the packing flags)."""
        d = self.data
        return bool(d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss
                    or self.optim.calculate_per_token_loss)

    def _check_packing(self) -> None:
        if not self.packing():
            return
        if self.parallel.forward_backward_disaggregating:
            raise ConfigError("--reset-position-ids/--reset-attention-mask/--eod-mask-loss/"
                              "--calculate-per-token-loss do not run with "
                              "--forward-backward-disaggregating yet")

    def check(self, world_size: int) -> Plan:
        """Every check that needs neither a model nor a collective; raises
        :class:`ConfigError` naming the flag. Returns the derived :class:`Plan`."""

        par, m, o = self.parallel, self.model, self.optim
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        cp = par.context_parallel_size
        wave = par.pipeline_schedule == "zb-v" and pp > 1
        v = par.virtual_pipeline_model_parallel_size or (2 if wave else 1)
        for name, value in (("--tensor-model-parallel-size", tp),
                            ("--pipeline-model-parallel-size", pp), ("--num-layers", m.num_layers),
                            ("--context-parallel-size", cp),
                            ("--hidden-size", m.hidden_size), ("--seq-length", m.seq_length),
                            ("--num-attention-heads", m.num_attention_heads),
                            ("--micro-batch-size", o.micro_batch_size),
                            ("--global-batch-size", o.global_batch_size),
                            ("--virtual-pipeline-model-parallel-size", v),
                            ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        self._check_packing()
        if o.optimizer != "adam" and o.optimizer_impl == "fused":
            raise ConfigError(f"--optimizer-impl fused is AdamW's; --optimizer {o.optimizer} "
                              "runs torch's (drop --optimizer-impl)")
        for name, value in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2),
                            ("--sgd-momentum", o.sgd_momentum)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value}")
        check_lr_schedule(o, self.explicit, ConfigError)
        self._check_optimizer()
        resolve_train_iters(o)
        for name, value in (("--train-iters", o.train_iters), ("--eval-iters", o.eval_iters),
                            ("--eval-interval", o.eval_interval),
                            ("--grad-compression-start-iter",
                             self.data_parallel.grad_compression_start_iter)):
            if value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if world_size % (tp * pp * cp) != 0:
            raise ConfigError(f"world size {world_size} is not divisible by "
                              f"--tensor-model-parallel-size {tp} x "
                              f"--pipeline-model-parallel-size {pp}"
                              + (f" x --context-parallel-size {cp}" if cp > 1 else ""))
        if v > 1 and pp == 1:
            raise ConfigError("--virtual-pipeline-model-parallel-size needs "
                              "--pipeline-model-parallel-size > 1")
        dp = world_size // (tp * pp * cp)
        if o.global_batch_size % (o.micro_batch_size * dp) != 0:
            raise ConfigError(
                f"--global-batch-size {o.global_batch_size} is not divisible by "
                f"--micro-batch-size {o.micro_batch_size} x data-parallel size {dp}")
        microbatches = o.global_batch_size // (o.micro_batch_size * dp)
        if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
            raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by "
                              f"--num-attention-heads {m.num_attention_heads} (set --kv-channels "
                              "to decouple the head size)")
        self._check_block(tp)
        if m.num_attention_heads % tp:
            raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible "
                              f"by --tensor-model-parallel-size {tp}")
        ffn = m.ffn_hidden_size if m.ffn_hidden_size is not None else 4 * m.hidden_size
        if ffn % tp:
            raise ConfigError(f"--ffn-hidden-size {ffn} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
        if par.sequence_parallel and tp > 1 and m.seq_length % tp:
            raise ConfigError(f"--seq-length {m.seq_length} must be divisible by the "
                              f"tensor-parallel size {tp} with --sequence-parallel")
        self._check_context_parallel(tp, cp)
        self._check_tp_comm_overlap(tp)
        self._check_fbd(pp, dp, v, microbatches)
        try:
            layout = layer_layout(
                m.num_layers, pp, v, first=par.decoder_first_pipeline_num_layers,
                last=par.decoder_last_pipeline_num_layers,
                layout=parse_layout(par.pipeline_layer_layout) if par.pipeline_layer_layout
                else None)
            if pp > 1:  # the schedule itself checks m against p (e.g. interleaved)
                make_schedule(par.pipeline_schedule, pp, microbatches, v,
                              policy=par.pipeline_dynamic_policy,
                              memory_limit=par.pipeline_memory_limit,
                              replan_interval=par.pipeline_replan_interval)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        spec = self.data_parallel.grad_compression
        if spec != "none":
            try:
                Compression(spec)
            except (ValueError, RuntimeError) as e:
                raise ConfigError(f"--grad-compression {spec}: {e}") from None
        if self.data_parallel.overlap_param_gather and not self.data_parallel.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather overlaps ZeRO-1's parameter all-gather: it "
                              "needs --use-distributed-optimizer")
        if self.data_parallel.bucket_size_mb <= 0:
            raise ConfigError(f"--bucket-size-mb must be positive, got "
                              f"{self.data_parallel.bucket_size_mb}")
        self._check_precision_and_recompute(tp > 1 and par.sequence_parallel)
        self._check_moe(dp, cp)
        ck = self.checkpoint
        if ck.save_interval is not None and ck.save_interval < 1:
            raise ConfigError(f"--save-interval must be >= 1, got {ck.save_interval}")
        if not ck.no_watchdog and world_size > 1 and ck.watchdog_timeout <= 2.0:
            raise ConfigError(f"--watchdog-timeout must exceed 2 s (twice the heartbeat), "
                              f"got {ck.watchdog_timeout}")
        if self.memory.record_alloc_trace and not self.memory.memory_pool:
            raise ConfigError("--record-alloc-trace needs --memory-pool")
        if self.memory.record_alloc_trace and self.device_type() != "cpu":
            raise ConfigError("--record-alloc-trace records the CPU pool; run on CPU (gloo)")
        tr = self.trace
        if tr.trace_interval < 1:
            raise ConfigError(f"--trace-interval must be >= 1, got {tr.trace_interval}")
        if tr.trace_detect_interval and not tr.trace:
            raise ConfigError("--trace-detect-interval needs --trace")
        self._check_data()
        return Plan(world_size, tp, pp, dp, v, microbatches, layout,
                    "wave" if wave else "loop")

    def _check_optimizer(self) -> None:
        """--optimizer muon and its flags; --manual-gc's."""
        o = self.optim
        if o.optimizer == "muon":
            if self.parallel.forward_backward_disaggregating:
                raise ConfigError("--optimizer muon does not run with "
                                  "--forward-backward-disaggregating yet (use --optimizer adam "
                                  "there)")
            if not 0.0 <= o.muon_momentum < 1.0 or o.muon_num_ns_steps < 1:
                raise ConfigError("--muon-momentum must be in [0, 1) and --muon-num-ns-steps "
                                  ">= 1")
        if o.manual_gc_interval < 0:
            raise ConfigError(f"--manual-gc-interval {o.manual_gc_interval}: must be >= 0 "
                              "(0: collect only after setup and around evaluations)")
        if not o.manual_gc and (o.manual_gc_interval or o.no_manual_gc_eval):
            raise ConfigError("--manual-gc-interval / --no-manual-gc-eval set how --manual-gc "
                              "collects: add --manual-gc (without it Python's automatic "
                              "collector runs)")

    def _check_tp_comm_overlap(self, tp: int) -> None:
        par = self.parallel
        subflags = ("disable_tp_comm_overlap_ag", "disable_tp_comm_overlap_rs",
                    "tp_comm_overlap_rs_dgrad", "disable_tp_comm_bulk_dgrad",
                    "disable_tp_comm_bulk_wgrad", "tp_comm_overlap_splits")
        if not par.tp_comm_overlap:
            if any(getattr(par, f) != getattr(ParallelConfig, f) for f in subflags):
                raise ConfigError("--disable-tp-comm-*/--tp-comm-overlap-rs-dgrad/"
                                  "--tp-comm-overlap-splits tune --tp-comm-overlap: add it")
            return
        if tp < 2 or not par.sequence_parallel:
            raise ConfigError("--tp-comm-overlap overlaps sequence parallelism's collectives "
                              "with the GEMMs: it needs --sequence-parallel and "
                              f"--tensor-model-parallel-size >= 2 (got {tp})")
        if par.tp_comm_overlap_splits < 1:
            raise ConfigError(f"--tp-comm-overlap-splits must be >= 1, got "
                              f"{par.tp_comm_overlap_splits}")
        if self.precision.fp8_format is not None:
            raise ConfigError("--tp-comm-overlap does not run with --fp8-format yet (the FP8 "
                              "linears gather their own operands); drop one of them")

    def _check_context_parallel(self, tp: int, cp: int) -> None:
        par, m = self.parallel, self.model
        if cp == 1:
            return
        if m.seq_length % (2 * cp):
            raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x "
                              f"--context-parallel-size ({2 * cp}): each rank holds two of "
                              f"2 x cp equal chunks; use a multiple of {2 * cp}")
        if par.sequence_parallel and tp > 1 and (m.seq_length // cp) % tp:
            raise ConfigError(f"--seq-length {m.seq_length} / --context-parallel-size {cp} "
                              f"must be divisible by the tensor-parallel size {tp} with "
                              "--sequence-parallel")
        if par.cp_comm_type == "a2a" and (m.num_attention_heads // tp) % cp:
            raise ConfigError(f"--cp-comm-type a2a needs the heads per tensor rank "
                              f"({m.num_attention_heads // tp}) divisible by "
                              f"--context-parallel-size {cp}; use --cp-comm-type p2p")
        if m.attention_dropout > 0:
            raise ConfigError("--attention-dropout with --context-parallel-size > 1 is not "
                              "supported (the ring attention has no dropout); set it to 0")

    def _check_moe(self, dp: int, cp: int = 1) -> None:
        moe, ep = self.moe, self.moe.expert_model_parallel_size
        if ep < 1:
            raise ConfigError(f"--expert-model-parallel-size must be >= 1, got {ep}")
        if moe.num_experts is None:
            if ep > 1:
                raise ConfigError("--expert-model-parallel-size needs --num-experts")
            return
        tp = self.parallel.tensor_model_parallel_size
        etp = moe.expert_tensor_parallel_size or tp
        if moe.expert_tensor_parallel_size is not None and (etp < 1 or tp % etp):
            raise ConfigError(f"--expert-tensor-parallel-size {etp} must divide "
                              f"--tensor-model-parallel-size {tp} (an expert's shards stay "
                              "within one tensor group)")
        if (tp // etp * cp * dp) % ep:
            ctx = f" x context-parallel size {cp}" if cp > 1 else ""
            raise ConfigError(f"--expert-model-parallel-size {ep} does not divide "
                              f"tensor / expert-tensor size ({tp}/{etp}){ctx} x data-parallel "
                              f"size {dp} = {tp // etp * cp * dp}: experts are sharded over "
                              "data-parallel ranks (the context ranks' too) and the tensor "
                              "ranks beyond the expert-tensor size")
        if moe.num_experts % ep:
            raise ConfigError(f"--num-experts {moe.num_experts} is not divisible by "
                              f"--expert-model-parallel-size {ep}")
        ffn = moe.moe_ffn_hidden_size or self.model.ffn_hidden_size or 4 * self.model.hidden_size
        if ffn % etp:
            raise ConfigError(f"the expert hidden size {ffn} is not divisible by the "
                              f"expert-tensor-parallel size {etp} "
                              "(--expert-tensor-parallel-size, default the tensor-parallel "
                              "size)")
        if etp != tp and (self.model.seq_length // cp) % (tp // etp):
            raise ConfigError(f"--seq-length {self.model.seq_length}"
                              + (f" / --context-parallel-size {cp}" if cp > 1 else "")
                              + f" is not divisible by tensor / expert-tensor size {tp // etp}: "
                              "each of those tensor ranks routes one slice of the sequence")
        if moe.moe_dispatch_compression not in ("none", "bf16", "fp16") and \
                not moe.moe_dispatch_compression.startswith("int8"):
            raise ConfigError(f"--moe-dispatch-compression {moe.moe_dispatch_compression!r}: "
                              "expected none, int8[:block], bf16 or fp16")
        if not 1 <= moe.moe_router_topk <= moe.num_experts:
            raise ConfigError(f"--moe-router-topk {moe.moe_router_topk} must be in [1, "
                              f"--num-experts {moe.num_experts}]")
        if moe.moe_expert_capacity_factor is not None and moe.moe_expert_capacity_factor <= 0:
            raise ConfigError(f"--moe-expert-capacity-factor must be > 0, got "
                              f"{moe.moe_expert_capacity_factor}")
        try:
            from ..models.gpt import GPTConfig

            GPTConfig(vocab_size=128, hidden_size=self.model.hidden_size,
                      num_layers=self.model.num_layers,
                      num_attention_heads=self.model.num_attention_heads,
                      **self.model.block_kwargs(), **self.moe_model_kwargs())
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_block(self, tp: int) -> None:
        m = self.model
        if m.group_query_attention:
            ng = m.num_query_groups
            if ng < 1 or m.num_attention_heads % ng:
                raise ConfigError(f"--num-query-groups {ng} must divide --num-attention-heads "
                                  f"{m.num_attention_heads}")
            if ng % tp and tp % ng:
                raise ConfigError(f"--num-query-groups {ng} and --tensor-model-parallel-size "
                                  f"{tp}: one must divide the other (query groups are split "
                                  "over the tensor ranks, or each is replicated over tp / groups "
                                  "ranks)")
        try:
            from ..models.gpt import GPTConfig

            GPTConfig(vocab_size=128, hidden_size=m.hidden_size, num_layers=m.num_layers,
                      num_attention_heads=m.num_attention_heads, **m.block_kwargs())
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def moe_model_kwargs(self) -> dict:
        """The GPTConfig fields of the MoE flags (empty for a dense model)."""
        moe = self.moe
        if moe.num_experts is None:
            return {}
        return dict(
            num_experts=moe.num_experts, moe_layer_freq=moe.layer_freq(),
            moe_ffn_hidden_size=moe.moe_ffn_hidden_size, moe_router_topk=moe.moe_router_topk,
            moe_router_score_function=moe.moe_router_score_function,
            moe_router_pre_softmax=moe.moe_router_pre_softmax,
            moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
            moe_aux_loss_coeff=moe.moe_aux_loss_coeff, moe_z_loss_coeff=moe.moe_z_loss_coeff,
            moe_expert_capacity_factor=moe.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=moe.moe_pad_expert_input_to_capacity,
            moe_token_drop_policy=moe.moe_token_drop_policy,
            moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=moe.moe_router_bias_update_rate,
            moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
            moe_dispatch_compression=moe.moe_dispatch_compression,
            moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
            moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor,
            moe_router_num_groups=moe.moe_router_num_groups,
            moe_router_group_topk=moe.moe_router_group_topk)

    def _check_data(self) -> None:
        from ..data.gpt_dataset import parse_data_path, parse_split
        from ..data.indexed import exists
        from ..data.tokenizers import build_tokenizer

        d = self.data
        try:  # missing --vocab-file, an unreadable model, no tokenizers package ...
            build_tokenizer(**d.tokenizer_kwargs())
        except (ValueError, OSError, ImportError) as e:
            raise ConfigError(f"--tokenizer-type {d.tokenizer_type}: {e}") from None
        paths = d.paths()
        if not paths or not d.is_indexed():
            return
        try:
            parse_split(d.split)
            _, prefixes = parse_data_path(paths)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for p in prefixes:
            if not exists(p):
                what = "a text file or an indexed dataset" if len(paths) == 1 else \
                    "an indexed dataset"
                raise ConfigError(
                    f"--data-path {p}: not {what} ({p}.idx / {p}.bin not found; make them "
                    "with python -m megatronapp.data.preprocess --input FILE --output-prefix P)")

    def _check_fbd(self, pp: int, dp: int, v: int, microbatches: int) -> None:
        """--forward-backward-disaggregating: the ratio, the grid and the batch fit."""
        par = self.parallel
        if not par.forward_backward_disaggregating:
            return
        try:
            f, b = parse_ratio(par.fbd_ratio)
            if v > 1:
                raise ValueError("--forward-backward-disaggregating runs one model chunk per "
                                 "stage; drop --virtual-pipeline-model-parallel-size (zb-v runs "
                                 "two: pick another --pipeline-schedule)")
            if self.data_parallel.overlap_param_gather:
                raise ValueError("--forward-backward-disaggregating sends the new weights to the "
                                 "forward ranks right after the step; drop "
                                 "--overlap-param-gather")
            if self.model.mtp_num_layers:
                raise ValueError("--forward-backward-disaggregating does not run multi-token "
                                 "prediction yet; drop --mtp-num-layers")
            if par.context_parallel_size > 1 or self.moe.num_experts is not None:
                raise ValueError("--forward-backward-disaggregating does not run with context "
                                 "parallelism or MoE layers yet; drop --context-parallel-size / "
                                 "--num-experts")
            program(FBDLayout(dp, f, b), pp, (f + b) * microbatches)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_precision_and_recompute(self, sequence_parallel: bool) -> None:
        """--bf16/--fp16 and the loss scaler, recomputation, dropout, the memory limit."""
        pr = self.precision
        if pr.bf16 and pr.fp16:
            raise ConfigError("--bf16 and --fp16 exclude each other; pick one")
        if pr.loss_scale is not None and not pr.loss_scale > 0:
            raise ConfigError(f"--loss-scale must be positive, got {pr.loss_scale}")
        if pr.fp16 and not 0 < pr.min_loss_scale <= pr.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale {pr.min_loss_scale} must be in (0, "
                              f"--initial-loss-scale {pr.initial_loss_scale}]")
        if pr.loss_scale_window < 1 or pr.hysteresis < 1:
            raise ConfigError("--loss-scale-window and --hysteresis must be >= 1")
        if pr.fp8_format is None and any(
                getattr(pr, f) != getattr(PrecisionConfig, f) for f in (
                    "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo",
                    "fp8_margin")):
            raise ConfigError("--fp8-recipe/--fp8-amax-history-len/--fp8-amax-compute-algo/"
                              "--fp8-margin set how FP8 scales: add --fp8-format e4m3|hybrid")
        if pr.fp8_format is not None:
            try:
                pr.fp8()
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if self.parallel.forward_backward_disaggregating:
                raise ConfigError("--fp8-format does not run with "
                                  "--forward-backward-disaggregating yet (the forward ranks "
                                  "would need the backward ranks' scales)")
        rc = self.recompute
        if rc.recompute_activations and rc.recompute_granularity not in (None, "selective"):
            raise ConfigError(f"--recompute-activations (selective) contradicts "
                              f"--recompute-granularity {rc.recompute_granularity}")
        if rc.granularity() == "auto":
            if self.memory.memory_limit_gb is None:
                raise ConfigError("--recompute-granularity auto needs --memory-limit-gb X (the "
                                  "memory per rank it plans for)")
            if rc.recompute_method is not None or rc.recompute_num_layers is not None:
                raise ConfigError("--recompute-granularity auto picks --recompute-method and "
                                  "--recompute-num-layers itself; drop them")
        else:
            try:
                check_recompute(rc.granularity(), rc.recompute_method, rc.recompute_num_layers,
                                rc.distribute_saved_activations, sequence_parallel)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.memory.memory_limit_gb is not None and not self.memory.memory_limit_gb > 0:
            raise ConfigError(f"--memory-limit-gb must be positive, got "
                              f"{self.memory.memory_limit_gb}")
        for name, value in (("--hidden-dropout", self.model.hidden_dropout),
                            ("--attention-dropout", self.model.attention_dropout)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value}")

    def backend(self) -> str:
        """The c10d backend --distributed-backend resolves to."""
        backend = self.parallel.distributed_backend
        if backend == "auto":
            import torch

            backend = "nccl" if torch.cuda.is_available() else "gloo"
        return backend

    def device_type(self) -> str:
        return "cuda" if self.backend() == "nccl" else "cpu"


# ---- the command line ----------------------------------------------------------------
def _argparse_type(annotation):
    """int / float / str of a field annotation like ``int | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


class _Parser(argparse.ArgumentParser):
    """Records which flags the command line gave (``args.mapp_explicit_flags``):
    a checkpoint's architecture fills in only the others (``--load``)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        given = argparse.ArgumentParser(add_help=False)
        for action in self._actions:
            if not action.option_strings or action.dest == "help":
                continue
            if action.nargs == 0:  # store_true
                given.add_argument(*action.option_strings, dest=action.dest,
                                   default=argparse.SUPPRESS, action="store_true")
            else:
                given.add_argument(*action.option_strings, dest=action.dest,
                                   default=argparse.SUPPRESS, nargs=action.nargs)
        seen, _ = given.parse_known_args(args)
        ns.mapp_explicit_flags = frozenset(vars(seen))
        return ns, rest


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The Megatron-style parser, generated from the :class:`Config` sections."""
    p = _Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for _attr, title, section in SECTIONS:
        group = p.add_argument_group(title)
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            meta = dict(f.metadata)
            flags = ["--" + f.name.replace("_", "-"), *meta.pop("aliases", ())]
            kind = _argparse_type(hints[f.name])
            if kind is bool:
                group.add_argument(*flags, action="store_true", help=meta.pop("help"))
            else:
                group.add_argument(*flags, type=kind, default=f.default, **meta)
    return p
