"""Python handles on the C++ collectives (torch.ops.mapp.*), which run on a c10d
group resolved by name. Autograd-aware wrappers live in tensor_parallel.mappings."""

from __future__ import annotations

import torch.distributed as dist

import torch


def default_store() -> dist.Store:
    """The default process group's rendezvous store (ranks meet through it
    without a collective: flag checks, checkpoint commits, heartbeats)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()  # noqa: SLF001 (torch has no public getter)


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


def coalesced_all_reduce_(tensors: list, group: dist.ProcessGroup,
                          scale: float | None = None) -> None:
    """Sums `tensors` over `group` in place (then multiplies by `scale`),
    packing same-dtype tensors into flat buffers of at most 25 MiB so that
    many small tensors cost few calls (``torch.ops.mapp.coalesced_all_reduce_``,
    the C++ engine's)."""
    torch.ops.mapp.coalesced_all_reduce_(list(tensors), group.group_name,
                                         None if scale is None else float(scale))
