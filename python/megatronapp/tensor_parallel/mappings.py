"""Conjugate communication functions of tensor and sequence parallelism.

Each is an autograd function whose backward is the conjugate collective of its
forward (Megatron-LM's mappings), running on the tensor-parallel group through
the C++ collectives:

====================================  ======================  ======================
function                              forward                 backward
====================================  ======================  ======================
copy_to_tensor_model_parallel_region  identity                all-reduce
reduce_from_tensor_model_parallel_..  all-reduce              identity
scatter_to_tensor_model_parallel_..   split last dim          all-gather last dim
gather_from_tensor_model_parallel_..  all-gather last dim     split last dim
scatter_to_sequence_parallel_region   split dim 0             all-gather dim 0
gather_from_sequence_parallel_region  all-gather dim 0        reduce-scatter dim 0 *
reduce_scatter_to_sequence_parallel.  reduce-scatter dim 0    all-gather dim 0
====================================  ======================  ======================

(*) or a plain split when ``tensor_parallel_output_grad=False``, i.e. when the
consumer's gradient is already identical on every member.

Sequence parallelism shards the first dim, Megatron's [sequence, batch, hidden]
layout. Every function takes ``group=None`` meaning the tensor group of the
default :class:`~megatronapp.parallel_state.ParallelState`.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

from .. import _collectives
from ..parallel_state import get_parallel_state


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else get_parallel_state().tensor_group


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    world = group.size()
    if world == 1:
        return x
    if x.size(dim) % world != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {x.size(dim)} across {world} tensor-parallel "
            "ranks; the size must be divisible by the tensor-parallel size"
        )
    return x.chunk(world, dim=dim)[group.rank()].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _collectives.all_reduce_sum_(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # Reduce in place when x is a fresh intermediate (the usual case: a
        # matmul output); autograd's version counter guards any other reader.
        is_view = x._base is not None  # noqa: SLF001 (torch: whether x is a view)
        if not is_view and not (x.is_leaf and x.requires_grad) and x.is_contiguous():
            ctx.mark_dirty(x)
            return _collectives.all_reduce_sum_(x, group)
        return _collectives.all_reduce_sum_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _collectives.all_gather(grad.contiguous(), ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, reduce_scatter_grad):
        ctx.dim, ctx.group, ctx.reduce_scatter_grad = dim, group, reduce_scatter_grad
        return _collectives.all_gather(x.contiguous(), dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_scatter_grad:
            g = _collectives.reduce_scatter_sum(grad.contiguous(), ctx.dim, ctx.group)
        else:
            g = _split(grad, ctx.dim, ctx.group)
        return g, None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _collectives.reduce_scatter_sum(x.contiguous(), dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _collectives.all_gather(grad.contiguous(), ctx.dim, ctx.group), None, None


def copy_to_tensor_model_parallel_region(x, group=None):
    return _CopyToRegion.apply(x, _group(group))


def reduce_from_tensor_model_parallel_region(x, group=None):
    return _ReduceFromRegion.apply(x, _group(group))


def scatter_to_tensor_model_parallel_region(x, group=None):
    return _ScatterToRegion.apply(x, -1, _group(group))


def gather_from_tensor_model_parallel_region(x, group=None):
    return _GatherFromRegion.apply(x, -1, _group(group), False)


def scatter_to_sequence_parallel_region(x, group=None):
    return _ScatterToRegion.apply(x, 0, _group(group))


def gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=None):
    return _GatherFromRegion.apply(x, 0, _group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return _ReduceScatterToRegion.apply(x, 0, _group(group))
