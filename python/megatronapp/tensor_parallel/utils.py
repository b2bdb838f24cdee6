"""Partition bookkeeping for tensor-parallel parameters.

Every sharded parameter carries three attributes (Megatron's names):
``tensor_model_parallel = True``, ``partition_dim`` (the dim split across the
tensor group) and ``partition_stride = 1``. Parameters that are replicated over
the tensor group but see only part of the sequence under sequence parallelism
carry ``sequence_parallel = True``: their gradients are partial sums that
:func:`megatronapp.training.finalize_model_grads` all-reduces over the group
(so do replicated parameters each rank applies to its own heads: the
query/key LayerNorms, a replicated grouped-query QKV).

A *stacked* parameter (the SwiGLU fc1: gate rows then up rows) is ``k``
blocks along dim 0, each split over the tensor group, so a rank holds
``[gate_r; up_r]`` (Megatron's layout). It carries ``partition_view`` (the
local tensor viewed as ``[k, rows/k, ...]``) and its ``partition_dim`` is 1
of that view: in the view's coordinates the shard is one contiguous slice,
which is how checkpoints store and reshard it (:func:`partition_view`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

import torch

from .. import _collectives
from ..parallel_state import ParallelState, get_parallel_state, resolve_state  # noqa: F401


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError that says what did not divide."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size "
            f"({denominator}); choose sizes that divide evenly"
        )
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, partition_dim: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def split_over(param: torch.Tensor, state: ParallelState) -> tuple[int, int]:
    """(size, rank) of the group a sharded `param` is split over: the
    expert-tensor group for an MoE expert's weights (``expert_parallel``;
    ``--expert-tensor-parallel-size``), the tensor group otherwise."""
    if getattr(param, "expert_parallel", False):
        return state.etp_size, state.etp_rank
    return state.tp_size, state.tp_rank


def partition_view(param: torch.Tensor) -> tuple[tuple, int | None]:
    """(local shape to view `param` in, dim split over the tensor group in
    that view; None when replicated). Plain sharded parameters: their own
    shape and ``partition_dim``; stacked ones: ``[k, rows/k, ...]`` and 1."""
    if not is_tensor_parallel(param):
        return tuple(param.shape), None
    view = getattr(param, "partition_view", None)
    return (tuple(view), param.partition_dim) if view is not None else \
        (tuple(param.shape), param.partition_dim)


def sharded_parameter(
    full_shape: tuple,
    partition_dim: int | None,
    state: ParallelState,
    init_method: Callable[[torch.Tensor], None],
    dtype: torch.dtype | None = None,
    device=None,
    stacked: int = 1,
) -> torch.nn.Parameter:
    """This rank's slice of a parameter split along `partition_dim` over the
    tensor group (None: replicated, the whole tensor).

    The full (master) tensor is initialized on the CPU with the global RNG and
    sliced: every rank draws the same full tensor (seed them identically), so a
    model is the same function for every tensor-parallel size. Split parameters
    get the tensor_model_parallel / partition_dim / partition_stride attributes.

    ``stacked=k`` (with ``partition_dim=0``): dim 0 is k equal blocks, each
    split over the group (module docstring)."""
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)
    if stacked > 1:
        if partition_dim != 0 or full_shape[0] % (stacked * state.tp_size):
            raise ValueError(f"a stacked parameter of shape {tuple(full_shape)}: dim 0 must be "
                             f"{stacked} blocks each divisible by the tensor-parallel size "
                             f"{state.tp_size}")
        view = full.view(stacked, full_shape[0] // stacked, *full_shape[1:])
        local = view.chunk(state.tp_size, dim=1)[state.tp_rank].reshape(
            full_shape[0] // state.tp_size, *full_shape[1:])
        param = torch.nn.Parameter(local.to(dtype=dtype or torch.get_default_dtype(),
                                            device=device))
        set_tensor_model_parallel_attributes(param, 1)
        param.partition_view = (stacked, full_shape[0] // stacked // state.tp_size,
                                *full_shape[1:])
        return param
    if partition_dim is not None:
        # clone, not contiguous(): a row slice is already contiguous, and a view
        # would keep the whole tensor alive on every rank.
        full = full.chunk(state.tp_size, dim=partition_dim)[state.tp_rank].clone(
            memory_format=torch.contiguous_format)
    param = torch.nn.Parameter(full.to(dtype=dtype or torch.get_default_dtype(), device=device))
    if partition_dim is not None:
        set_tensor_model_parallel_attributes(param, partition_dim)
    return param


def shard_full_tensor(full: torch.Tensor, param: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's slice of `full` for the (possibly sharded) parameter `param`."""
    if not is_tensor_parallel(param):
        return full
    view, dim = partition_view(param)
    size, rank = split_over(param, state)
    gview = list(view)
    gview[dim] *= size
    return full.reshape(gview).chunk(size, dim=dim)[rank].reshape(param.shape)


@torch.no_grad()
def load_full_state_dict(
    module: torch.nn.Module, full: dict, parallel_state: ParallelState | None = None
) -> None:
    """Loads an unsharded (tensor-parallel size 1) state dict into a sharded module."""
    state = resolve_state(parallel_state)
    params = dict(module.named_parameters())
    missing = [k for k in params if k not in full]
    if missing:
        raise KeyError(f"full state dict lacks parameters {missing}")
    for name, p in params.items():
        src = shard_full_tensor(full[name], p, state)
        if src.shape != p.shape:
            raise ValueError(
                f"{name}: full tensor {tuple(full[name].shape)} slices to "
                f"{tuple(src.shape)} on shard {split_over(p, state)[1]}, parameter is "
                f"{tuple(p.shape)}"
            )
        p.copy_(src)


@torch.no_grad()
def gather_full_state_dict(
    module: torch.nn.Module, parallel_state: ParallelState | None = None
) -> dict:
    """The unsharded parameters of a sharded module (collective over the tensor
    group; an expert's weights over the expert-tensor group)."""
    state = resolve_state(parallel_state)
    out = {}
    for name, p in module.named_parameters():
        group = state.expert_tensor_group if getattr(p, "expert_parallel", False) \
            else state.tensor_group
        if is_tensor_parallel(p) and group is not None:
            view, dim = partition_view(p)
            full = _collectives.all_gather(p.detach().reshape(view).contiguous(), dim, group)
            out[name] = full.reshape(-1, *p.shape[1:]).clone()
        else:
            out[name] = p.detach().clone()
    return out


def tensor_group_of(parallel_state: ParallelState | None) -> dist.ProcessGroup:
    return resolve_state(parallel_state).tensor_group
