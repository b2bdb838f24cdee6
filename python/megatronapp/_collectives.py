"""Python handles on the C++ collectives (torch.ops.mapp.*), which run on a c10d
group resolved by name. Autograd-aware wrappers live in tensor_parallel.mappings."""

from __future__ import annotations

import torch.distributed as dist

import torch


def group_size(group: dist.ProcessGroup) -> int:
    return group.size()


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place sum over `group`; returns `tensor`."""
    if group.size() == 1:
        return tensor
    return torch.ops.mapp.all_reduce_(tensor, group.group_name)


def all_gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenation along `dim` of every member's tensor, in group-rank order."""
    if group.size() == 1:
        return tensor
    return torch.ops.mapp.all_gather(tensor, dim, group.group_name)


def reduce_scatter_sum(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over `group`, keeping this member's slice of `dim`."""
    if group.size() == 1:
        return tensor
    return torch.ops.mapp.reduce_scatter(tensor, dim, group.group_name)
