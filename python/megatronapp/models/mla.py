"""Multi-latent attention (MLA; DeepSeek-V2/V3), Megatron-LM's
``--multi-latent-attention`` with its ``--q-lora-rank --kv-lora-rank
--qk-head-dim --qk-pos-emb-head-dim --v-head-dim`` flags.

Keys and values come from one compressed latent per token:

    c_kv, k_pe = split(x W_kv_down, [kv_lora_rank, qk_pos_emb_head_dim])
    k_nope, v  = split(RMSNorm(c_kv) W_kv_up, per head [qk_head_dim, v_head_dim])
    q          = x W_q  or  RMSNorm(x W_q_down) W_q_up     (--q-lora-rank)
    q_nope, q_pe = split(q, per head [qk_head_dim, qk_pos_emb_head_dim])
    scores     = [q_nope, rope(q_pe)] . [k_nope, rope(k_pe)] * softmax_scale

``k_pe`` is one rotary key shared by every head (the "decoupled" RoPE key), so
positions never enter the latent. The softmax scale is
``1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, times ``mscale(factor,
--yarn-mscale-all-dim)^2`` with YaRN.

Tensor parallelism (as Megatron-Core): the down projections and the latent
norms are whole on every tensor rank ("duplicated"); the up projections are
column-parallel over heads (rows ordered [head, (nope, pe)] and [head, (k, v)],
so a row shard is whole heads) and the output projection row-parallel. With
sequence parallelism the down projections run on this rank's sequence shard
and the up projections gather the small latents (not the hidden states); the
duplicated weights then hold partial gradients, summed over the tensor group
with the other sequence-parallel parameters. The shared rotary key is gathered
the same way (its gradient, a sum over every rank's heads, is reduce-scattered).
Context parallelism (ring or all-to-all), selective and full recomputation,
zero-bubble's deferred weight gradients and the scope taps come from
:class:`~megatronapp.models.gpt.ParallelAttention`, which this extends.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel_state import ParallelState
from ..tensor_parallel import ColumnParallelLinear, DuplicatedLinear, RowParallelLinear, mappings
from .gpt import (
    MLA_ATTENTION,
    GPTConfig,
    ParallelAttention,
    make_norm,
    mark_sequence_parallel,
    normal_init,
)
from .rotary import yarn_mscale

__all__ = ["MultiLatentAttention"]


class MultiLatentAttention(ParallelAttention):
    """MLA with heads split over the tensor group (see the module docstring)."""

    def __init__(self, cfg: GPTConfig, state: ParallelState, output_std: float,
                 layer_number: int = 0):
        nn.Module.__init__(self)
        self._init_core(cfg, state, layer_number)
        tp, sp = state.tp_size, cfg.sequence_parallel
        self.qk_dim, self.pe_dim, self.v_dim = (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
                                                cfg.v_head_dim)
        self.kv_rank = cfg.kv_lora_rank
        self.group, self.sp = state.tensor_group, sp and tp > 1
        heads, h = cfg.num_attention_heads, cfg.hidden_size
        q_out = heads * (self.qk_dim + self.pe_dim)
        init = normal_init(cfg.init_method_std)
        self.q_proj = self.q_down = self.q_norm = self.q_up = None
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, q_out, bias=False, sequence_parallel=sp,
                                               init_method=init, parallel_state=state)
        else:
            self.q_down = DuplicatedLinear(h, cfg.q_lora_rank, sequence_parallel=self.sp,
                                           init_method=init, parallel_state=state)
            self.q_norm = make_norm(cfg, cfg.q_lora_rank)
            mark_sequence_parallel(self.q_norm, self.sp)
            self.q_up = ColumnParallelLinear(cfg.q_lora_rank, q_out, bias=False,
                                             sequence_parallel=sp, init_method=init,
                                             parallel_state=state)
        self.kv_down = DuplicatedLinear(h, self.kv_rank + self.pe_dim, sequence_parallel=self.sp,
                                        init_method=init, parallel_state=state)
        self.kv_norm = make_norm(cfg, self.kv_rank)
        mark_sequence_parallel(self.kv_norm, self.sp)
        self.kv_up = ColumnParallelLinear(self.kv_rank, heads * (self.qk_dim + self.v_dim),
                                          bias=False, sequence_parallel=sp, init_method=init,
                                          parallel_state=state)
        self.rotary = self._make_rotary(cfg, self.pe_dim, 1.0)
        self.softmax_scale = (self.qk_dim + self.pe_dim) ** -0.5
        yarn = cfg.yarn()
        if yarn is not None and yarn["mscale_all_dim"]:
            self.softmax_scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
        self.proj = RowParallelLinear(
            heads * self.v_dim, h, bias=cfg.add_bias_linear, input_is_parallel=True,
            sequence_parallel=sp, init_method=normal_init(output_std), parallel_state=state)

    queries_per_group = 1  # every head has its own key and value (cached whole)

    def grouped_heads(self, x: torch.Tensor):
        """q, k [b, local heads, s, qk + pe] and v [b, local heads, s, v] of `x`
        [s (/tp under SP), b, hidden]. A KV cache stores k and v per head (the
        up-projected latent, not the latent itself)."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_up(self.q_norm(self.q_down(x)))
        latent, k_pe = self.kv_down(x).split([self.kv_rank, self.pe_dim], dim=-1)
        kv = self.kv_up(self.kv_norm(latent))
        if self.sp:  # the whole sequence of the shared rotary key
            k_pe = mappings.gather_from_sequence_parallel_region(k_pe, True, self.group)
        elif self.group is not None and self.group.size() > 1:  # its gradient sums every head
            k_pe = mappings.copy_to_tensor_model_parallel_region(k_pe, self.group)
        s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, self.heads_local, self.qk_dim + self.pe_dim).permute(1, 2, 0, 3)
        q_nope, q_pe = q.split([self.qk_dim, self.pe_dim], dim=-1)
        kv = kv.view(s, b, self.heads_local, self.qk_dim + self.v_dim).permute(1, 2, 0, 3)
        k_nope, v = kv.split([self.qk_dim, self.v_dim], dim=-1)
        q_pe, k_pe = self._rotate(q_pe, k_pe.permute(1, 0, 2).unsqueeze(1))  # k_pe [b, 1, s, pe]
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.heads_local, -1, -1)], dim=-1)
        return q, k, v.contiguous()


MLA_ATTENTION[:] = [MultiLatentAttention]
