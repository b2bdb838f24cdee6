"""Gradient norm and clipping over a model-parallel model: the one
implementation, for full gradients and ZeRO-1 shards alike.

    norm = gradients.clip_grad_norm_(pairs, max_norm, state, groups=[state.model_group])

`pairs` are ``(param, grad)``: ``grad`` is the parameter's full gradient or
the slice of it this rank owns (ZeRO-1). Which pairs count is decided by
:func:`counted`: tensor-parallel shards on every tensor rank, replicated
parameters on tensor rank 0 only, and the last pipeline stage's replica of
tied embeddings not at all (the first stage counts it). Each tensor's norm
is taken in one multi-tensor pass and the squares of those norms are
summed in float64 on the gradients' device; the only host synchronization is
the one that reads the final norm. The norm and the clipping are the C++
engine's (``mapp::global_grad_norm`` / ``mapp::clip_grads_`` in
``include/mapp/torch/ddp.h``, which the C++ trainers call too); this module
decides which gradients count.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

from .. import _C  # noqa: F401  (registers torch.ops.mapp)
from ..parallel_state import ParallelState
from ..tensor_parallel.utils import is_tensor_parallel

__all__ = ["counted", "global_norm", "clip_", "clip_grad_norm_"]


def counted(param: torch.Tensor, state: ParallelState | None) -> bool:
    """Whether `param`'s gradient enters the norm on this rank: tensor-parallel
    shards (an expert's shards included) on every tensor rank, replicated
    parameters on tensor rank 0 only, the last stage's replica of tied
    embeddings nowhere."""
    if getattr(param, "shared_embedding_replica", False):
        return False
    tp_rank = state.tp_rank if state is not None else 0
    return is_tensor_parallel(param) or tp_rank == 0


@torch.no_grad()
def global_norm(pairs, state: ParallelState | None, groups: list[dist.ProcessGroup],
                device: torch.device | None = None,
                expert_groups: list[dist.ProcessGroup] | None = None) -> float:
    """L2 norm of the counted gradients of `pairs`, summed over `groups`
    (e.g. the data group for ZeRO-1 shards, then the model group). Under an
    expert grid (:meth:`ParallelState.expert_norm_groups`, not None when
    ep > 1 or etp != tp) MoE experts' squares are summed apart, over
    `expert_groups`, where every expert shard lives on exactly one rank;
    otherwise experts are tensor-parallel parameters like the others."""
    pairs = list(pairs)
    if device is None:
        device = pairs[0][1].device if pairs else torch.device("cpu")
    split = expert_groups is not None
    dense = [g.detach() for p, g in pairs
             if not (split and getattr(p, "expert_parallel", False)) and counted(p, state)]
    experts = [g.detach() for p, g in pairs if split and getattr(p, "expert_parallel", False)]
    return torch.ops.mapp.global_grad_norm(
        dense, [g.group_name for g in groups if g is not None], experts,
        [g.group_name for g in expert_groups or [] if g is not None], split, device)


@torch.no_grad()
def clip_(grads: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scales `grads` in place so that a total norm of `norm` becomes at most
    `max_norm` (no-op when ``max_norm <= 0`` or the norm is already below)."""
    torch.ops.mapp.clip_grads_(list(grads), float(max_norm), float(norm))


def clip_grad_norm_(pairs, max_norm: float, state: ParallelState | None,
                    groups: list[dist.ProcessGroup], device: torch.device | None = None,
                    expert_groups: list[dist.ProcessGroup] | None = None) -> float:
    """:func:`global_norm` of `pairs`, then :func:`clip_` of all their
    gradients; returns the norm before clipping."""
    pairs = list(pairs)
    norm = global_norm(pairs, state, groups, device, expert_groups)
    clip_([g for _, g in pairs], max_norm, norm)
    return norm
