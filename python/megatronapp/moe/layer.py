"""The MoE layer: router, token dispatcher, local experts, combine.

Input and output are the transformer's [s, b, h] (under sequence
parallelism [s/tp, b, h]). Every tensor-parallel rank routes the same
tokens (the sequence shards are gathered first), its expert-parallel peers
are the ranks with the same tensor rank (``ParallelState.expert_group``),
and the experts' tensor-parallel partial sums are reduced once, after the
combine (all-reduce, or reduce-scatter back to the sequence shard).

Expert tensor parallelism smaller than tp (``--expert-tensor-parallel-size``
etp, Megatron-Core's expert grid): the tp / etp groups of etp tensor ranks
each dispatch one contiguous slice of the sequence (the union of their
sequence-parallel shards), the experts' weights are split over etp ranks
only, and the other tensor ranks join the expert-parallel grid. The router
still scores every token on every tensor rank (a [T, h] x [h, E] product),
so its losses, its expert-bias load and its gradients are those of one rank;
the routing weights of the slice are taken with a split whose backward
gathers their gradients over the token group. After the combine the slice is
reduced over the etp ranks and the slices are gathered (or, under sequence
parallelism, reduce-scattered straight back to each rank's shard).

The router's auxiliary losses reach the router through backward without
being added to the language-model loss: :class:`AuxLoss` passes the
activations through unchanged and hands the aux loss a gradient of the
layer's ``aux_loss_scale`` (else the module-wide :func:`aux_loss_scale`;
Megatron's MoEAuxLossAutoScaler), which the training step sets to
1 / microbatches (times the fp16 loss scale). The value of the last forward is
kept in ``layer.last_aux_loss`` (a tensor) for logging.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _collectives
from .. import trace as _trace
from ..models import gpt as _gpt
from ..parallel_state import ParallelState
from ..tensor_parallel import mappings
from .dispatcher import combine, dispatch
from .experts import GroupedMLP
from .router import Router

_AUX_SCALE = [1.0]


def set_aux_loss_scale(scale: float) -> None:
    """What the aux losses' gradient is: 1 / microbatches x loss scale."""
    _AUX_SCALE[0] = float(scale)


def aux_loss_scale() -> float:
    return _AUX_SCALE[0]


class AuxLoss(torch.autograd.Function):
    """Identity on `x`; in backward hands `aux` the gradient `scale`."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.dtype, ctx.device, ctx.scale = aux.dtype, aux.device, scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.dtype, device=ctx.device), None


class _ScaleGrad(torch.autograd.Function):
    """Identity; the gradient times `scale` (the router's share of a gradient
    that the tensor group's reduce-scatter sums)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class MoELayer(nn.Module):
    is_moe_layer = True  #: how megatronapp.moe.moe_layers finds it

    def __init__(self, cfg, state: ParallelState, output_std: float, seed: int):
        super().__init__()
        E, ep = cfg.num_experts, state.ep_size
        if E % ep:
            raise ValueError(f"--num-experts {E} is not divisible by "
                             f"--expert-model-parallel-size {ep}")
        self.cfg, self.state = cfg, state
        self.num_experts, self.num_local = E, E // ep
        self.sequence_parallel = cfg.sequence_parallel and state.tp_size > 1
        self.router = Router(
            cfg.hidden_size, E, cfg.moe_router_topk,
            score_function=cfg.moe_router_score_function, pre_softmax=cfg.moe_router_pre_softmax,
            load_balancing_type=cfg.moe_router_load_balancing_type,
            aux_loss_coeff=cfg.moe_aux_loss_coeff, z_loss_coeff=cfg.moe_z_loss_coeff,
            capacity_factor=cfg.moe_expert_capacity_factor,
            drop_policy=cfg.moe_token_drop_policy,
            enable_expert_bias=cfg.moe_router_enable_expert_bias,
            bias_update_rate=cfg.moe_router_bias_update_rate, init_std=cfg.init_method_std,
            topk_scaling_factor=getattr(cfg, "moe_router_topk_scaling_factor", None),
            num_groups=getattr(cfg, "moe_router_num_groups", None),
            group_topk=getattr(cfg, "moe_router_group_topk", None))
        #: tp / etp: the token slices the tensor group's experts see
        self.token_slices = state.tp_size // state.etp_size
        self.experts = GroupedMLP(
            cfg.hidden_size, cfg.moe_ffn_hidden_size, state.ep_rank * self.num_local,
            self.num_local, tp_size=state.etp_size, tp_rank=state.etp_rank, seed=seed,
            init_std=cfg.init_method_std, output_std=output_std,
            swiglu=getattr(cfg, "swiglu", False))
        self.shared_experts = None
        # shared experts: a dense tensor-parallel MLP beside them (the newer
        # config fields are optional: an older caller's config object lacks them)
        if getattr(cfg, "moe_shared_expert_intermediate_size", None):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((seed * 1_000_003 + 15_485_863) % (2**63 - 1))
                self.shared_experts = _gpt.ParallelMLP(
                    cfg, state, output_std, cfg.moe_shared_expert_intermediate_size)
        self.group = state.expert_group
        self.last_aux_loss = torch.zeros(())
        self.last_tokens_per_expert: list[int] = []
        #: the aux losses' gradient (None: the module-wide aux_loss_scale());
        #: the training step sets 1 / microbatches x the fp16 loss scale
        self.aux_loss_scale: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp_group = self.state.tensor_group
        if self.sequence_parallel:
            full = mappings.gather_from_sequence_parallel_region(x, True, tp_group)
            route_in = _ScaleGrad.apply(full, 1.0 / self.state.tp_size)
            expert_in = full
        else:
            route_in = x
            expert_in = mappings.copy_to_tensor_model_parallel_region(x, tp_group)
        s, b, h = expert_in.shape
        tokens = expert_in.reshape(s * b, h)
        # seq_aux_loss: under context parallelism a sequence's tokens are spread
        # over the context group
        probs, idx, aux = self.router(route_in.reshape(s * b, h), seq_shape=(s, b),
                                      seq_group=self.state.context_group
                                      if self.state.cp_size > 1 else None)
        n = self.token_slices
        if n > 1:  # this rank's experts see slice g of the tokens
            if s % n:
                raise ValueError(f"the sequence ({s} positions on this tensor rank) is not "
                                 f"divisible by tp / expert-tensor-parallel size = {n}")
            rows, g = s * b // n, self.state.expert_token_index
            tokens, idx = tokens[g * rows:(g + 1) * rows], idx[g * rows:(g + 1) * rows]
            probs = mappings.scatter_to_sequence_parallel_region(
                probs, self.state.expert_token_group)
        cap = self.router.capacity(tokens.shape[0])
        recv, tpe, plan = dispatch(
            tokens, idx, self.num_experts, capacity=cap,
            pad=bool(self.cfg.moe_pad_expert_input_to_capacity),
            compression=self.cfg.moe_dispatch_compression, group=self.group)
        self.last_tokens_per_expert = tpe.tolist()
        # Its own compute scope: the slow-rank detector compares it across the
        # stage's ranks, so a rank slowed by overloaded experts is named as such.
        with _trace.scope("moe_experts", "compute", lane=0):
            y = self.experts(recv, self.last_tokens_per_expert)
        # The experts' outputs are partial sums over the expert-tensor group,
        # so is the gradient of the routing weights: summed over it in backward.
        etp_group = self.state.expert_tensor_group
        probs = probs.to(y.dtype)
        if etp_group is not None:
            probs = mappings.copy_to_tensor_model_parallel_region(probs, etp_group)
        out = combine(y, probs, plan, group=self.group).view(s // n, b, h)
        if n == 1:
            if self.sequence_parallel:
                out = mappings.reduce_scatter_to_sequence_parallel_region(out, tp_group)
            else:
                out = mappings.reduce_from_tensor_model_parallel_region(out, tp_group)
        elif self.sequence_parallel:  # slice g = the etp group's sequence shards
            if etp_group is not None:
                out = mappings.reduce_scatter_to_sequence_parallel_region(out, etp_group)
        else:
            if etp_group is not None:
                out = mappings.reduce_from_tensor_model_parallel_region(out, etp_group)
            out = mappings.gather_from_sequence_parallel_region(
                out, False, self.state.expert_token_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self.last_aux_loss = aux.detach()  # a tensor: no host synchronization per layer
        if aux.requires_grad and self.training:
            scale = self.aux_loss_scale if self.aux_loss_scale is not None else aux_loss_scale()
            out = AuxLoss.apply(out, aux, scale)
        return out

    @torch.no_grad()
    def update_expert_bias(self, data_group=None) -> None:
        """After a step: DeepSeek-V3's bias update from the step's load summed
        over `data_group` (every tensor rank saw the same tokens); no-op without
        an expert bias."""
        r = self.router
        if r.expert_bias is None:
            return
        load = r.local_tokens_per_expert.clone()
        if data_group is not None and data_group.size() > 1:
            _collectives.all_reduce_sum_(load, data_group)
        r.update_expert_bias(load)


_gpt.MOE_LAYER[:] = [MoELayer]
