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
layout. The autograd functions are C++ (``mapp::nn``, ``src/torch/nn.cc``, the
one implementation the C++ trainers use too), reached as
``torch.ops.mapp.tp_*``. Every function takes ``group=None`` meaning the tensor group of the
default :class:`~megatronapp.parallel_state.ParallelState`.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

from .. import _C  # noqa: F401  (registers torch.ops.mapp)
from ..parallel_state import get_parallel_state


def _group(group: dist.ProcessGroup | None) -> str:
    return (group if group is not None else get_parallel_state().tensor_group).group_name


def copy_to_tensor_model_parallel_region(x, group=None):
    return torch.ops.mapp.tp_copy_to(x, _group(group))


def reduce_from_tensor_model_parallel_region(x, group=None):
    return torch.ops.mapp.tp_reduce_from(x, _group(group))


def scatter_to_tensor_model_parallel_region(x, group=None):
    return torch.ops.mapp.tp_scatter_to(x, -1, _group(group))


def gather_from_tensor_model_parallel_region(x, group=None):
    return torch.ops.mapp.tp_gather_from(x, -1, _group(group), False)


def scatter_to_sequence_parallel_region(x, group=None):
    return torch.ops.mapp.tp_scatter_to(x, 0, _group(group))


def gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=None):
    return torch.ops.mapp.tp_gather_from(x, 0, _group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return torch.ops.mapp.tp_reduce_scatter_to(x, _group(group))
