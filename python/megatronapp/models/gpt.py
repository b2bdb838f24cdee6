"""A Megatron-style GPT built only from the tensor-parallel layers.

Pre-norm decoder blocks with causal self-attention; attention heads and
the MLP's hidden units are split across the tensor group; activations inside
the model use Megatron's [sequence, batch, hidden] layout so that sequence
parallelism can shard dim 0. Input and output embeddings are tied by default.

For a given seed the model is the same function at every tensor-parallel size:
each layer draws its full weight and keeps its slice.

The block is GPT-2's by default (LayerNorm, GELU, learned positions, biases,
multi-head attention) and every modern variant by Megatron-LM's flags
(:class:`GPTConfig`): RMSNorm, SwiGLU, RoPE (partial, interleaved, Llama-3.1
scaling), grouped-query attention, no biases, QKV biases (Qwen2), query/key
normalization (Qwen3), SwiGLU experts with shared experts (Mixtral,
DeepSeek-style MoE). Fused QKV rows are ordered per query group ``[group,
(its query heads, key, value), kv_channels]`` (Megatron's layout; with one
query per group it is the multi-head ``[head, (q, k, v), d]``), so a
contiguous row shard is a whole set of groups.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch.nn.functional as F

import torch
from torch import nn

from .. import packed_sequence
from ..autograd import linear
from ..parallel_state import ParallelState
from ..tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mappings,
    overlap,
    vocab_parallel_cross_entropy,
)
from ..tensor_parallel.random import check_recompute, checkpoint, dropout, get_rng_tracker
from ..tensor_parallel.utils import divide, resolve_state, sharded_parameter
from . import kv_cache
from . import scope_taps as taps
from .fusions import scaled_causal_softmax, scaled_causal_softmax_dropout
from .rotary import RotaryEmbedding, apply_rotary, positions


@dataclass
class GPTConfig:
    """Shape of the model. Fields mirror Megatron-LM's flags."""

    vocab_size: int  #: padded vocabulary; divisible by the tensor-parallel size
    hidden_size: int = 256
    num_layers: int = 4
    num_attention_heads: int = 8  #: divisible by the tensor-parallel size
    seq_length: int = 256  #: maximum sequence length (learned positions)
    ffn_hidden_size: int | None = None  #: default 4 * hidden_size
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    sequence_parallel: bool = False  #: shard LayerNorm/residual activations over tp
    share_embeddings_and_output_weights: bool = True
    hidden_dropout: float = 0.0  #: after the embeddings, attention and MLP (Megatron: 0.1)
    attention_dropout: float = 0.0  #: on the attention probabilities (Megatron: 0.1)
    #: "auto"/"flash"/"fused": torch's fused scaled_dot_product_attention (no
    #: [s, s] scores kept); "unfused"/"local": scores, softmax, dropout and the
    #: value product as separate ops, as Megatron's local core attention.
    attention_backend: str = "auto"
    #: "causal" (GPT) or "no_mask" (bidirectional: the ViT encoder)
    attn_mask_type: str = "causal"
    #: None, "selective" (recompute core attention) or "full" (whole layers).
    recompute_granularity: str | None = None
    recompute_method: str | None = None  #: full: "uniform" or "block"
    recompute_num_layers: int | None = None  #: full: layers per group / first N layers
    distribute_saved_activations: bool = False  #: full: keep 1/tp of each layer input
    #: context parallelism (the parallel state's cp > 1): "p2p" ring attention
    #: or "a2a" (Ulysses); inputs are this rank's zigzag chunks of the sequence
    cp_comm_type: str = "p2p"
    # ---- mixture of experts (Megatron's --num-experts and --moe-* flags) ----
    num_experts: int | None = None  #: None: dense MLPs everywhere
    #: int N: every N-th layer (0, N, 2N, ...) is MoE; or a 0/1 list per layer
    moe_layer_freq: int | list = 1
    moe_ffn_hidden_size: int | None = None  #: default ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  #: or "sigmoid" (DeepSeek-V3)
    moe_router_pre_softmax: bool = False
    moe_router_load_balancing_type: str = "aux_loss"  #: or "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None  #: None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"  #: or "position"
    moe_router_enable_expert_bias: bool = False  #: aux-loss-free balancing
    moe_router_bias_update_rate: float = 1e-3
    moe_token_dispatcher_type: str = "alltoall"
    moe_dispatch_compression: str = "none"  #: or "int8" (block-scaled token rows)
    #: shared experts (Megatron's --moe-shared-expert-intermediate-size): a
    #: dense MLP of this hidden size every MoE layer adds to its experts' output
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_topk_scaling_factor: float | None = None  #: scale the top-k weights
    moe_router_num_groups: int | None = None  #: group-limited routing: groups of experts
    moe_router_group_topk: int | None = None  #: ... and how many of them a token may reach
    # ---- the block (Megatron-LM's flags; defaults: GPT-2's block) ----
    normalization: str = "LayerNorm"  #: or "RMSNorm"
    swiglu: bool = False  #: gated MLP silu(x W_gate) * (x W_up) (experts too)
    #: "learned_absolute", "rope" or "none"
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  #: fraction of each head's channels rotated
    rotary_interleaved: bool = False  #: rotate channel pairs (2i, 2i+1), not (i, i + rot/2)
    use_rope_scaling: bool = False  #: Llama-3.1's long-context frequency scaling
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position: int = 8192
    num_query_groups: int | None = None  #: grouped-query attention (None: one per head)
    kv_channels: int | None = None  #: per-head channels (default hidden / heads)
    add_bias_linear: bool = True  #: biases of QKV, projection, fc1, fc2
    add_qkv_bias: bool = False  #: a QKV bias even without add_bias_linear (Qwen2)
    qk_layernorm: bool = False  #: normalize each query and key head (Qwen3)
    # ---- YaRN (--position-embedding-type yarn; DeepSeek-V3's long-context RoPE) ----
    yarn_rotary_scaling_factor: float = 1.0  #: context extension factor
    yarn_original_max_position_embeddings: int = 4096  #: the context the base was trained at
    yarn_beta_fast: float = 32.0  #: dimensions turning more often keep their frequency
    yarn_beta_slow: float = 1.0  #: dimensions turning less often are fully interpolated
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0  #: MLA: softmax scale x mscale(factor, this)^2
    # ---- multi-latent attention (DeepSeek-V2/V3; models/mla.py) ----
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  #: None: queries straight from the hidden states
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  #: per-head query/key channels without position
    qk_pos_emb_head_dim: int = 64  #: per-head rotary channels (one shared rotary key)
    v_head_dim: int = 128
    # ---- multi-token prediction (DeepSeek-V3; models/mtp.py) ----
    mtp_num_layers: int | None = None  #: MTP depths on the last stage (None: off)
    mtp_loss_scaling_factor: float = 0.1  #: the MTP losses' weight (divided by the depths)

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set --kv-channels to decouple them")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        self._check_block()
        check_recompute(self.recompute_granularity, self.recompute_method,
                        self.recompute_num_layers, self.distribute_saved_activations,
                        self.sequence_parallel)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.num_experts is not None:
            self._check_moe()
        if self.attn_mask_type not in ("causal", "no_mask"):
            raise ValueError(f"attn_mask_type {self.attn_mask_type!r}: expected causal or no_mask")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r}: expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")

    def _check_block(self) -> None:
        choices = {"normalization": ("LayerNorm", "RMSNorm"),
                   "position_embedding_type": ("learned_absolute", "rope", "none", "yarn")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: expected "
                                 f"one of {', '.join(allowed)}")
        ng, heads = self.num_query_groups, self.num_attention_heads
        if ng < 1 or heads % ng:
            raise ValueError(f"--num-query-groups {ng} must divide --num-attention-heads "
                             f"{heads} (every query group has the same number of heads)")
        if self.kv_channels < 1:
            raise ValueError(f"--kv-channels must be >= 1, got {self.kv_channels}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope" and \
                int(self.kv_channels * self.rotary_percent) < 2:
            raise ValueError(f"--rotary-percent {self.rotary_percent} of kv_channels "
                             f"{self.kv_channels} rotates no channel pair")
        if self.use_rope_scaling and self.rope_scaling_factor <= 0:
            raise ValueError(f"--rope-scaling-factor must be > 0, got {self.rope_scaling_factor}")
        if self.position_embedding_type == "yarn":
            if self.yarn_rotary_scaling_factor < 1:
                raise ValueError("--yarn-rotary-scaling-factor must be >= 1, got "
                                 f"{self.yarn_rotary_scaling_factor}")
            if self.yarn_original_max_position_embeddings < 1 or \
                    not 0 < self.yarn_beta_slow <= self.yarn_beta_fast:
                raise ValueError("YaRN needs --yarn-original-max-position-embeddings >= 1 and "
                                 "0 < --yarn-beta-slow <= --yarn-beta-fast")
        if self.multi_latent_attention:
            self._check_mla()
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ValueError(f"--mtp-num-layers must be >= 1, got {self.mtp_num_layers}")

    def _check_mla(self) -> None:
        if self.position_embedding_type not in ("rope", "yarn"):
            raise ValueError("--multi-latent-attention rotates its decoupled key with RoPE: use "
                             "--position-embedding-type rope or yarn")
        if self.qk_layernorm or self.num_query_groups != self.num_attention_heads:
            raise ValueError("--multi-latent-attention has its own latent norms and one key per "
                             "head: drop --qk-layernorm and --group-query-attention")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.qk_pos_emb_head_dim < 2 or self.qk_pos_emb_head_dim % 2:
            raise ValueError("--qk-pos-emb-head-dim must be even and >= 2 (rotated in pairs), "
                             f"got {self.qk_pos_emb_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"--q-lora-rank must be >= 1, got {self.q_lora_rank}")

    def yarn(self) -> dict | None:
        """The YaRN parameters of the rotary embedding (None without YaRN)."""
        if self.position_embedding_type != "yarn":
            return None
        return {"factor": self.yarn_rotary_scaling_factor,
                "original_max_position": self.yarn_original_max_position_embeddings,
                "beta_fast": self.yarn_beta_fast, "beta_slow": self.yarn_beta_slow,
                "mscale": self.yarn_mscale, "mscale_all_dim": self.yarn_mscale_all_dim}

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    def _check_moe(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"--num-experts must be >= 1, got {self.num_experts}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.moe_token_dispatcher_type != "alltoall":
            raise ValueError(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type!r}: "
                             "only alltoall is implemented")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs "
                             "--moe-expert-capacity-factor")
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            if len(freq) != self.num_layers or any(f not in (0, 1) for f in freq):
                raise ValueError(f"--moe-layer-freq {list(freq)}: expected {self.num_layers} "
                                 "entries of 0 (dense) or 1 (MoE), one per layer")
        elif not isinstance(freq, int) or freq < 1:
            raise ValueError(f"--moe-layer-freq {freq!r}: expected an int >= 1 or a 0/1 list")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has experts (Megatron's --moe-layer-freq)."""
        if self.num_experts is None:
            return False
        layer = min(layer, self.num_layers - 1)  # MTP layers are the last layer's kind
        return bool(moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer])

    def _layer_weights(self, i: int, active: bool) -> tuple[int, int]:
        """(matrix weights, other parameters: norms, biases) of global layer
        ``i`` (``num_layers``: an MTP depth's layer); with ``active``, what one
        token uses (a MoE layer's router and top-k experts)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        d, heads, ng = self.kv_channels, self.num_attention_heads, self.num_query_groups
        rms = self.normalization == "RMSNorm"
        norm = h if rms else 2 * h
        bias = self.add_bias_linear
        qkv_out = (heads + 2 * ng) * d
        mats = qkv_out * h + heads * d * h
        other = 2 * norm + (qkv_out if self.qkv_bias else 0) + (h if bias else 0)
        if self.qk_layernorm:
            other += 2 * (d if rms else 2 * d)
        if self.multi_latent_attention:
            qd, r, pe, vd = (self.qk_head_dim, self.kv_lora_rank, self.qk_pos_emb_head_dim,
                             self.v_head_dim)
            rq = self.q_lora_rank
            q = h * heads * (qd + pe) if rq is None else h * rq + rq * heads * (qd + pe)
            mats = q + h * (r + pe) + r * heads * (qd + vd) + heads * vd * h
            other = 2 * norm + (r if rms else 2 * r) + (h if bias else 0)
            if rq is not None:
                other += rq if rms else 2 * rq
        gate = 2 if self.swiglu else 1

        def mlp(width, with_bias):
            return gate * h * width + width * h, (gate * width + h) if with_bias else 0

        if not self.is_moe_layer(i):
            m, o = mlp(f, bias)
            return mats + m, other + o
        experts = self.moe_router_topk if active else self.num_experts
        m, _ = mlp(self.moe_ffn_hidden_size, False)
        mats += self.num_experts * h + experts * m  # the router, the experts
        if self.moe_shared_expert_intermediate_size:
            m, o = mlp(self.moe_shared_expert_intermediate_size, bias)
            mats, other = mats + m, other + o
        return mats, other

    def num_parameters(self, active: bool = False) -> int:
        """All parameters; with ``active``, those one token uses (MoE layers
        count the router and top-k experts)."""
        h, v, s, n = self.hidden_size, self.vocab_size, self.seq_length, self.num_layers
        norm = h if self.normalization == "RMSNorm" else 2 * h
        total = sum(sum(self._layer_weights(i, active)) for i in range(n))
        if self.mtp_num_layers:  # per depth: 3 norms, the 2h -> h projection, a layer
            total += self.mtp_num_layers * (3 * norm + 2 * h * h
                                            + sum(self._layer_weights(n, active)))
        out = 0 if self.share_embeddings_and_output_weights else v * h
        pos = s * h if self.position_embedding_type == "learned_absolute" else 0
        return v * h + pos + total + norm + out

    def flops_per_token(self) -> float:
        """Model FLOPs of one token's forward pass, as Megatron-LM counts them
        for its TFLOP/s and MFU: 2 per multiply-add of every matrix the token
        passes through (a MoE layer's router and top-k experts; the output
        layer), and the attention scores and their values over the whole
        sequence, 2 s heads (qk + v channels) per layer (not halved for the
        causal mask). Norms, biases, activations and the softmax are not
        counted. Forward plus backward is three times this; recomputation is
        not counted (model FLOPs, not hardware FLOPs)."""
        h, s, n, heads = self.hidden_size, self.seq_length, self.num_layers, self.num_attention_heads
        if self.multi_latent_attention:
            qk, v = self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim
        else:
            qk = v = self.kv_channels
        core = 2 * s * heads * (qk + v)
        head = 2 * self.vocab_size * h
        total = sum(2 * self._layer_weights(i, True)[0] + core for i in range(n)) + head
        if self.mtp_num_layers:  # per depth: the projection, a layer, the output layer
            total += self.mtp_num_layers * (2 * 2 * h * h + 2 * self._layer_weights(n, True)[0]
                                            + core + head)
        return float(total)


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def moe_layer_pattern(freq, num_layers: int) -> list:
    """--moe-layer-freq as 0/1 per layer: an int N marks layers 0, N, 2N, ...;
    a list is the pattern itself."""
    if isinstance(freq, (list, tuple)):
        return [int(f) for f in freq]
    return [int(i % freq == 0) for i in range(num_layers)]


def activation_dropout(x: torch.Tensor, p: float, training: bool, sharded: bool) -> torch.Tensor:
    """Dropout whose masks agree across the tensor group on replicated
    activations and differ on sharded ones (the tracked state)."""
    if not training or p == 0.0:
        return x
    if not sharded:
        return dropout(x, p)
    with get_rng_tracker().fork():
        return dropout(x, p)


def normal_init(std: float):
    return lambda t: nn.init.normal_(t, 0.0, std)


def mark_sequence_parallel(module: nn.Module, enabled: bool) -> None:
    for p in module.parameters():
        p.sequence_parallel = enabled


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in float32 (as
    Megatron's and Hugging Face's), returned in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return y * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(cfg: GPTConfig, size: int | None = None) -> nn.Module:
    """--normalization over `size` channels (default the hidden size)."""
    size = cfg.hidden_size if size is None else size
    if cfg.normalization == "RMSNorm":
        return RMSNorm(size, eps=cfg.layernorm_epsilon)
    return nn.LayerNorm(size, eps=cfg.layernorm_epsilon)


class _GroupedQKV(nn.Module):
    """The QKV projection when the tensor group is larger than the number of
    query groups (each group replicated over tp / groups ranks): the weight
    is whole on every rank, each rank projects with the rows of its query
    heads and its group's key and value, and the gradient (a partial sum
    over the tensor group) is summed by ``finalize_model_grads``."""

    def __init__(self, cfg: GPTConfig, state, rows: torch.Tensor):
        super().__init__()
        h, out = cfg.hidden_size, (cfg.num_attention_heads + 2 * cfg.num_query_groups) * \
            cfg.kv_channels
        self.group, self.sequence_parallel = state.tensor_group, cfg.sequence_parallel
        self.tp_comm_overlap = None  # tensor_parallel.overlap.enable
        self.weight = sharded_parameter((out, h), None, state, normal_init(cfg.init_method_std))
        self.weight.sequence_parallel = True  # partial sums over the tensor group
        self.bias = None
        if cfg.qkv_bias:
            self.bias = sharded_parameter((out,), None, state, nn.init.zeros_)
            self.bias.sequence_parallel = True
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.index_select(0, self.rows)
        b = self.bias.index_select(0, self.rows) if self.bias is not None else None
        if self.tp_comm_overlap is not None and self.sequence_parallel:
            return overlap.column_linear(x, w, b, self.group, self.tp_comm_overlap)
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, True, self.group)
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x, self.group)
        return linear(x, w, b)


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split across the tensor group. The fused
    QKV projection's output features are ordered [group, (its query heads, key,
    value), head_dim] ([head, (q, k, v), head_dim] with one query per group), so
    a contiguous row shard of the weight is a whole set of query groups; with
    fewer groups than tensor ranks each group is replicated (:class:`_GroupedQKV`).
    Optional per-head query/key norms and RoPE come before core attention; under
    grouped-query attention the key and value heads are then expanded to the
    query heads."""

    def __init__(self, cfg: GPTConfig, state: ParallelState, output_std: float,
                 layer_number: int = 0):
        super().__init__()
        self._init_core(cfg, state, layer_number)
        tp, sp = state.tp_size, cfg.sequence_parallel
        d, ng, heads = cfg.kv_channels, cfg.num_query_groups, cfg.num_attention_heads
        self.head_dim = d
        qkv_out = (heads + 2 * ng) * d
        if ng % tp == 0:  # whole query groups per rank: a contiguous row shard
            self.groups_local, self.queries_per_group = ng // tp, heads // ng
            self.qkv = ColumnParallelLinear(
                cfg.hidden_size, qkv_out, bias=cfg.qkv_bias, sequence_parallel=sp,
                init_method=normal_init(cfg.init_method_std), parallel_state=state)
        elif tp % ng == 0 and heads % tp == 0:  # each group replicated over tp / ng ranks
            per = tp // ng
            g, j = state.tp_rank // per, state.tp_rank % per
            self.groups_local, self.queries_per_group = 1, heads // tp
            base, qpg = g * (heads // ng + 2) * d, heads // ng
            q0 = base + j * self.queries_per_group * d
            rows = torch.cat([torch.arange(q0, q0 + self.queries_per_group * d),
                              torch.arange(base + qpg * d, base + (qpg + 2) * d)])
            self.qkv = _GroupedQKV(cfg, state, rows)
        else:
            raise ValueError(f"--num-query-groups {ng} and the tensor-parallel size {tp}: "
                             "one must divide the other (groups split over tensor ranks, or "
                             "each group replicated over tp / groups ranks)")
        # Muon orthogonalizes each query group's queries, key and value apart
        self.qkv.weight.qkv_split_shapes = (heads // ng * d, d, d)
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # per head; each rank feeds it its own heads
            self.q_layernorm, self.k_layernorm = make_norm(cfg, d), make_norm(cfg, d)
            mark_sequence_parallel(self.q_layernorm, tp > 1)
            mark_sequence_parallel(self.k_layernorm, tp > 1)
        self.rotary = self._make_rotary(cfg, d, cfg.rotary_percent)
        self.softmax_scale = d ** -0.5
        self.proj = RowParallelLinear(
            heads * d, cfg.hidden_size, bias=cfg.add_bias_linear, input_is_parallel=True,
            sequence_parallel=sp, init_method=normal_init(output_std), parallel_state=state)

    def _init_core(self, cfg: GPTConfig, state: ParallelState, layer_number: int) -> None:
        """What every attention variant shares: heads, dropout, backend, recompute,
        context parallelism (multi-latent attention builds its projections itself)."""
        self.layer_number = layer_number
        self.tapped = True  #: visible to an active scope (a VLM's encoder layers are not)
        self.heads_local = divide(cfg.num_attention_heads, state.tp_size, "num_attention_heads")
        self.dropout_p = cfg.attention_dropout
        self.backend = cfg.attention_backend
        self.fused = cfg.attention_backend in ("auto", "flash", "fused")
        self.selective = cfg.recompute_granularity == "selective"
        self.causal = cfg.attn_mask_type == "causal"
        self.context_group = state.context_group  # None: no context parallelism
        if self.context_group is not None and not self.causal:
            raise ValueError("context parallelism needs causal attention (attn_mask_type "
                             "no_mask is not supported with --context-parallel-size > 1)")
        self.cp_comm_type = cfg.cp_comm_type
        if self.context_group is not None and cfg.attention_dropout > 0:
            raise ValueError("attention dropout with context parallelism is not supported")
        self.cp_size, self.cp_rank = state.cp_size, state.cp_rank

    @staticmethod
    def _make_rotary(cfg: GPTConfig, dim: int, percent: float):
        """RoPE (Llama-3.1 scaling or YaRN as configured) over `dim` channels, or None."""
        if cfg.position_embedding_type not in ("rope", "yarn"):
            return None
        return RotaryEmbedding(
            dim, percent, cfg.rotary_base, interleaved=cfg.rotary_interleaved,
            scaling_factor=cfg.rope_scaling_factor if cfg.use_rope_scaling else None,
            low_freq_factor=cfg.rope_scaling_low_freq_factor,
            high_freq_factor=cfg.rope_scaling_high_freq_factor,
            original_max_position=cfg.rope_scaling_original_max_position, yarn=cfg.yarn())

    def _split_qkv(self, qkv: torch.Tensor):
        """q [b, heads, s, d], k and v [b, groups, s, d] of this rank."""
        s, b = qkv.shape[0], qkv.shape[1]
        qpg, d = self.queries_per_group, self.head_dim
        if qpg == 1 and self.groups_local == self.heads_local:  # multi-head attention
            qkv = qkv.view(s, b, self.heads_local, 3, d)
            return tuple(t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))
        qkv = qkv.view(s, b, self.groups_local, qpg + 2, d)
        q = qkv[:, :, :, :qpg].reshape(s, b, self.groups_local * qpg, d)
        k, v = qkv[:, :, :, qpg], qkv[:, :, :, qpg + 1]
        return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))

    def heads(self, x: torch.Tensor):
        """q, k, v [b, local heads, s, d] of `x` [s (/tp under SP), b, hidden]:
        projected, normalized and rotated as configured."""
        q, k, v = self.grouped_heads(x)
        return (q, *self.expand_groups(k, v))

    def grouped_heads(self, x: torch.Tensor):
        """q [b, local heads, s, d] and k, v [b, local query groups, s, d]:
        what a KV cache stores (before grouped-query expansion)."""
        qkv = self.qkv(x)  # [s, b, local (heads + 2 groups) * head_dim]
        q, k, v = self._split_qkv(qkv)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self._rotate(q, k)
        return q, k, v

    def expand_groups(self, k: torch.Tensor, v: torch.Tensor):
        """Every query head sees its group's key and value."""
        if self.queries_per_group > 1:
            k = k.repeat_interleave(self.queries_per_group, dim=1)
            v = v.repeat_interleave(self.queries_per_group, dim=1)
        return k, v

    def _rotate(self, q: torch.Tensor, k: torch.Tensor):
        if self.rotary is None:
            return q, k
        cos, sin = self.rotary.tables(q.shape[-2], self.cp_size, self.cp_rank, q.device, q.dtype)
        return (apply_rotary(q, cos, sin, self.rotary.interleaved),
                apply_rotary(k, cos, sin, self.rotary.interleaved))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = kv_cache.current()
        if cache is not None:
            return self._cached_forward(x, cache)
        q, k, v = self.heads(x)
        b, s = q.shape[0], q.shape[2]
        scope = taps.ACTIVE if self.tapped else None
        if scope is not None:
            q, k, v = (scope.tap(site, self.layer_number, t, "heads")
                       for site, t in (("query", q), ("key", k), ("value", v)))
        if self.selective:
            ctx = checkpoint(self.core_attention, False, q, k, v)
        else:
            ctx = self.core_attention(q, k, v)
        if scope is not None:
            ctx = scope.tap("attn_context", self.layer_number, ctx, "heads")
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * ctx.shape[-1])
        return self.proj(ctx)

    def _cached_forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Incremental decoding (models.kv_cache): the new columns' keys
        and values join the cache; their queries attend to everything cached."""
        if self.context_group is not None:
            raise ValueError("KV-cached generation runs without context parallelism")
        q, k, v = self.grouped_heads(x)
        k, v = self.expand_groups(*cache.extend(self, k, v))
        ctx = cache.attend(q, k, v, self.softmax_scale)
        b, s = q.shape[0], q.shape[2]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * ctx.shape[-1])
        return self.proj(ctx)

    def core_attention(self, q, k, v):
        """softmax(q k^T / sqrt(d), causal) v with dropout on the
        probabilities ([b, heads, s, d] each): the part selective
        recomputation recomputes. The heads are this rank's, so dropout
        draws from the tracked tensor-parallel state."""
        packed = packed_sequence.current() if self.causal else None
        segments = packed.segment_ids if packed is not None else None
        if self.context_group is not None:  # the sequence is split over the context group
            from .context_parallel import ring_attention, ulysses_attention
            fn = ring_attention if self.cp_comm_type == "p2p" else ulysses_attention
            return fn(q, k, v, self.context_group, scale=self.softmax_scale,
                      segment_ids=segments)
        p = self.dropout_p if self.training else 0.0
        scope = taps.ACTIVE if self.tapped else None
        if scope is not None and scope.needs_probs(self.layer_number):
            return self._probed_attention(q, k, v, p, scope, segments)
        if segments is not None:  # causal within each document
            return self._document_attention(q, k, v, segments, p)
        # auto: torch's fused attention, except on CPU with dropout, where it
        # falls back to its math path with torch's slow Bernoulli: there the
        # local path with the fused dropout kernel computes the same.
        if self.fused and not (p > 0.0 and q.device.type == "cpu" and self.backend == "auto"):
            if p == 0.0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                      scale=self.softmax_scale)
            with get_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal,
                                                      scale=self.softmax_scale)
        scores = torch.matmul(q, k.transpose(-1, -2))  # its backward keeps q, k only
        scale = self.softmax_scale
        if not self.causal:
            probs = torch.softmax(scores * scale, dim=-1)
            if p > 0.0:
                with get_rng_tracker().fork():
                    probs = dropout(probs, p)
            return torch.matmul(probs, v)
        if p == 0.0:
            return torch.matmul(scaled_causal_softmax(scores, scale), v)
        with get_rng_tracker().fork():  # this rank's heads: the tensor-parallel state
            probs = scaled_causal_softmax_dropout(scores, scale, p)
        return torch.matmul(probs, v)

    def _document_attention(self, q, k, v, segments, p):
        """Causal attention that stays within each token's document
        (--reset-attention-mask): torch's fused attention with the mask, or
        the unfused scores masked before the softmax."""
        idx = torch.arange(q.shape[-2], device=q.device)
        mask = packed_sequence.attention_mask(segments.to(q.device), idx, idx)
        if self.fused and not (p > 0.0 and q.device.type == "cpu" and self.backend == "auto"):
            if p == 0.0:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                      scale=self.softmax_scale)
            with get_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                      scale=self.softmax_scale)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        if p > 0.0:
            with get_rng_tracker().fork():
                probs = dropout(probs, p)
        return torch.matmul(probs, v)

    def _probed_attention(self, q, k, v, p, scope, segments=None):
        """The unfused path with the probabilities exposed to the scope (to
        watch or perturb them): used only while a scope asks for them."""
        if self.context_group is not None:
            raise ValueError("the scope's attn_probs site (and zero_head on it) is not available "
                             "under context parallelism: no rank holds a whole score matrix")
        scores, scale = torch.matmul(q, k.transpose(-1, -2)), self.softmax_scale
        if segments is not None:  # within each document (packed_sequence)
            idx = torch.arange(q.shape[-2], device=q.device)
            mask = packed_sequence.attention_mask(segments.to(q.device), idx, idx)
            probs = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)
        else:
            probs = scaled_causal_softmax(scores, scale) if self.causal else \
                torch.softmax(scores * scale, dim=-1)
        probs = scope.tap("attn_probs", self.layer_number, probs, "heads")
        if p > 0.0:
            with get_rng_tracker().fork():
                probs = dropout(probs, p)
        return torch.matmul(probs, v)


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))): GELU, or with ``swiglu`` fc1 holding the gate and up
    projections (stacked: this rank's gate rows, then its up rows) and
    silu(gate) * up. `ffn_hidden_size` overrides the config's (shared experts)."""

    def __init__(self, cfg: GPTConfig, state: ParallelState, output_std: float,
                 ffn_hidden_size: int | None = None):
        super().__init__()
        sp, f = cfg.sequence_parallel, ffn_hidden_size or cfg.ffn_hidden_size
        self.swiglu = cfg.swiglu
        gate = 2 if cfg.swiglu else 1
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, gate * f, bias=cfg.add_bias_linear, sequence_parallel=sp,
            init_method=normal_init(cfg.init_method_std), parallel_state=state, stacked=gate)
        self.fc2 = RowParallelLinear(
            f, cfg.hidden_size, bias=cfg.add_bias_linear, input_is_parallel=True,
            sequence_parallel=sp, init_method=normal_init(output_std), parallel_state=state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h, approximate="tanh"))


#: The MoE layer class, registered by megatronapp.moe when it is imported (the
#: feature depends on the model, not the reverse; importing megatronapp does it).
MOE_LAYER: list = []
#: Multi-latent attention and the multi-token prediction layer, registered by
#: megatronapp.models.mla / .mtp when imported (megatronapp.models imports them).
MLA_ATTENTION: list = []
MTP_LAYER: list = []


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig, state: ParallelState, layer_number: int = 0):
        super().__init__()
        self.dropout_p, self.sequence_parallel = cfg.hidden_dropout, cfg.sequence_parallel
        self.layer_number = layer_number
        self.tapped = True  #: visible to an active scope (a VLM's encoder layers are not)
        # GPT-2 / Megatron scaled init of the output projections.
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.ln1 = make_norm(cfg)
        if cfg.multi_latent_attention:
            if not MLA_ATTENTION:
                raise RuntimeError("GPTConfig(multi_latent_attention=True) needs the MLA module: "
                                   "import megatronapp (or megatronapp.models) first")
            self.attn = MLA_ATTENTION[0](cfg, state, output_std, layer_number)
        else:
            self.attn = ParallelAttention(cfg, state, output_std, layer_number)
        self.ln2 = make_norm(cfg)
        if cfg.is_moe_layer(layer_number):
            if not MOE_LAYER:
                raise RuntimeError("GPTConfig(num_experts=...) needs the MoE layer: import "
                                   "megatronapp (or megatronapp.moe) first")
            seed = int(torch.randint(0, 2**62, (1,)))  # from this layer's seeded stream
            self.mlp = MOE_LAYER[0](cfg, state, output_std, seed)
        else:
            self.mlp = ParallelMLP(cfg, state, output_std)
        mark_sequence_parallel(self.ln1, cfg.sequence_parallel)
        mark_sequence_parallel(self.ln2, cfg.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, sp = self.dropout_p, self.sequence_parallel
        x = x + activation_dropout(self.attn(self.ln1(x)), p, self.training, sharded=sp)
        scope = taps.ACTIVE if self.tapped else None
        if scope is None:
            return x + activation_dropout(self.mlp(self.ln2(x)), p, self.training, sharded=sp)
        kind, i = ("seq" if sp else "replicated"), self.layer_number
        y = self.mlp(scope.tap("mlp_in", i, self.ln2(x), kind))
        x = x + activation_dropout(scope.tap("mlp_out", i, y, kind), p, self.training, sharded=sp)
        return scope.tap("residual", i, x, kind)


@contextlib.contextmanager
def seeded(base: int, component: int):
    """Draws inside from the CPU RNG seeded for `component`; restores it after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((base * 1_000_003 + 7919 * (component + 1)) % (2**63 - 1))
        yield


class GPTModel(nn.Module):
    """``forward(input_ids [b, s], labels [b, s] | None)``: with labels, the
    per-token loss [b, s] (float32); without, the vocabulary-sharded logits
    [b, s, V/tp].

    Pipeline stages (Megatron's ``pre_process`` / ``post_process``): a stage
    without ``pre_process`` takes the hidden states [s, b, h] (sequence-sharded
    under sequence parallelism) instead of token ids; one without
    ``post_process`` returns them. ``layer_numbers`` are the global indices of
    the transformer layers this stage holds (default: all).

    Every component (embeddings, each layer, the head) is initialized from its
    own seed derived from ``seed`` (default ``torch.initial_seed()``), so the
    model is the same function at every tensor- and pipeline-parallel size.
    With tied embeddings split across stages, the last stage keeps a replica of
    the word embeddings (``shared_embedding_replica``) whose gradient
    ``finalize_model_grads`` sums with the first stage's over the embedding group.
    """

    def __init__(self, config: GPTConfig, *, parallel_state: ParallelState | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None, seed: int | None = None):
        super().__init__()
        state = resolve_state(parallel_state)
        cfg = self.config = config
        divide(cfg.vocab_size, state.tp_size, "vocab_size")
        divide(cfg.num_attention_heads, state.tp_size, "num_attention_heads")
        divide(cfg.ffn_hidden_size, state.tp_size, "ffn_hidden_size")
        if cfg.sequence_parallel and state.tp_size == 1:
            cfg.sequence_parallel = False  # nothing to shard
        self.group, self.sequence_parallel = state.tensor_group, cfg.sequence_parallel
        self.tp_comm_overlap = None  # the tied output layer's; tensor_parallel.overlap.enable
        self.cp_size, self.cp_rank = state.cp_size, state.cp_rank
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(range(cfg.num_layers) if layer_numbers is None else layer_numbers)
        if any(not 0 <= i < cfg.num_layers for i in self.layer_numbers):
            raise ValueError(f"layer_numbers {self.layer_numbers} outside [0, {cfg.num_layers})")
        base = torch.initial_seed() if seed is None else seed

        tied = cfg.share_embeddings_and_output_weights
        # MTP embeds the shifted tokens on the last stage: a replica there, as tied weights
        shared = tied or bool(cfg.mtp_num_layers)
        split = shared and not (pre_process and post_process)
        self.word_embeddings = self.position_embeddings = None
        if pre_process or (post_process and shared):
            with seeded(base, 0):
                self.word_embeddings = VocabParallelEmbedding(
                    cfg.vocab_size, cfg.hidden_size, init_method=normal_init(cfg.init_method_std),
                    parallel_state=state)
                position = None  # RoPE / none: no table (its draws came after the rest)
                if cfg.position_embedding_type == "learned_absolute":
                    position = nn.Embedding(cfg.seq_length, cfg.hidden_size)
                    nn.init.normal_(position.weight, 0.0, cfg.init_method_std)
            if pre_process:
                self.position_embeddings = position
            if split:
                self.word_embeddings.weight.shared_embedding = True
                self.word_embeddings.weight.shared_embedding_replica = not pre_process
        layers = []
        for i in self.layer_numbers:
            with seeded(base, 1 + i):
                layers.append(TransformerLayer(cfg, state, i))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = self.output_layer = None
        if post_process:
            with seeded(base, 1 + cfg.num_layers):
                self.final_layernorm = make_norm(cfg)
                mark_sequence_parallel(self.final_layernorm, cfg.sequence_parallel)
                if not tied:
                    self.output_layer = ColumnParallelLinear(
                        cfg.hidden_size, cfg.vocab_size, bias=False, gather_output=False,
                        sequence_parallel=cfg.sequence_parallel,
                        init_method=normal_init(cfg.init_method_std), parallel_state=state)
        self.mtp, self._mtp_hidden = None, None
        if post_process and cfg.mtp_num_layers:
            if not MTP_LAYER:
                raise RuntimeError("GPTConfig(mtp_num_layers=...) needs the MTP module: import "
                                   "megatronapp (or megatronapp.models) first")
            self.mtp = nn.ModuleList()
            for k in range(1, cfg.mtp_num_layers + 1):
                with seeded(base, 1 + cfg.num_layers + k):
                    self.mtp.append(MTP_LAYER[0](cfg, state, k))

    def forward(self, x: torch.Tensor | None, labels: torch.Tensor | None = None,
                decoder_input: torch.Tensor | None = None, packed=None):
        """`decoder_input` (first stage only; Megatron-Core's argument): the
        token embeddings [b, s, h] to use instead of embedding ``x`` (a
        multimodal model places image embeddings among them); the position
        embeddings are added to it. `packed`: the microbatch's
        :class:`~megatronapp.packed_sequence.PackedSeq` (documents kept apart
        in attention, positions restarting per document)."""
        if packed is not None:
            with packed_sequence.active(packed):
                return self.forward(x, labels, decoder_input)
        if self.pre_process:
            tokens = self.word_embeddings(x) if decoder_input is None else decoder_input
            b, s = tokens.shape[:2]
            if s * self.cp_size > self.config.seq_length:
                raise ValueError(
                    f"sequence length {s * self.cp_size} exceeds the model's seq_length "
                    f"{self.config.seq_length}")
            if self.position_embeddings is not None:  # learned absolute positions
                pk = packed_sequence.current()
                pos = pk.position_ids if pk is not None and pk.position_ids is not None else \
                    positions(s, self.cp_size, self.cp_rank, tokens.device)
                x = tokens + self.position_embeddings(pos)  # [b, s, h]
            else:
                x = tokens
            x = x.transpose(0, 1).contiguous()  # [s, b, h]
            if self.config.sequence_parallel:
                x = mappings.scatter_to_sequence_parallel_region(x, self.group)
            x = activation_dropout(x, self.config.hidden_dropout, self.training,
                         sharded=self.config.sequence_parallel)
        x = self._layers_forward(x)
        if not self.post_process:
            return x
        if self.mtp is not None and torch.is_grad_enabled():
            self._mtp_hidden = x  # for the MTP losses (take_mtp_hidden), before the final norm
        logits = self.output_logits(self.final_layernorm(x))
        if taps.ACTIVE is not None:
            logits = taps.ACTIVE.tap("logits", self.config.num_layers, logits, "vocab")
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), group=self.group)
        return loss.transpose(0, 1)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer (or the tied embedding) on normalized hidden
        states [s(/tp), b, h]: logits [s, b, V/tp]."""
        if self.output_layer is not None:
            return self.output_layer(x)
        if self.tp_comm_overlap is not None and self.config.sequence_parallel:
            return overlap.column_linear(x, self.word_embeddings.weight, None, self.group,
                                         self.tp_comm_overlap)
        if self.config.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, True, self.group)
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x, self.group)
        return linear(x, self.word_embeddings.weight)

    def take_mtp_hidden(self) -> torch.Tensor:
        """The last forward's hidden states before the final norm (MTP's
        input), handed over once."""
        h, self._mtp_hidden = self._mtp_hidden, None
        if h is None:
            raise RuntimeError("no hidden states for the MTP losses: the model's forward must run "
                               "(with gradients enabled) right before the loss")
        return h

    def _layers_forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward_layers(self.layers, x, self.config, self.group, self.training)


def forward_layers(layers, x: torch.Tensor, cfg: GPTConfig, group, training: bool):
    """A stage's transformer layers; with full recomputation, Megatron's
    methods: ``uniform`` keeps only the input of every group of
    ``recompute_num_layers`` consecutive layers and recomputes the group in
    backward; ``block`` recomputes each of the first ``recompute_num_layers``
    layers of this stage (chunk) and keeps the rest."""
    if cfg.recompute_granularity != "full" or not (training and torch.is_grad_enabled()):
        for layer in layers:
            x = layer(x)
        return x
    n, k = len(layers), cfg.recompute_num_layers
    dist_saved = cfg.distribute_saved_activations
    if cfg.recompute_method == "uniform":
        for start in range(0, n, k):
            chunk = layers[start:start + k]
            x = checkpoint(_run_layers(chunk), dist_saved, x, group=group)
        return x
    for i, layer in enumerate(layers):
        x = checkpoint(layer, dist_saved, x, group=group) if i < k else layer(x)
    return x


def _run_layers(layers):
    def run(x):
        for layer in layers:
            x = layer(x)
        return x
    return run
