"""Python handles on the C++ collectives (torch.ops.mapp.*), which run on a c10d
group resolved by name. Autograd-aware wrappers live in tensor_parallel.mappings."""

from __future__ import annotations

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: PLC2701

import torch

#: Flat buffers of coalesced_all_reduce_ stay below this many bytes.
COALESCE_BUCKET_BYTES = 25 * 1024 * 1024


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
    packing same-dtype tensors into flat buffers of at most
    :data:`COALESCE_BUCKET_BYTES` so that many small tensors cost few calls."""
    if group.size() == 1:
        if scale is not None:
            torch._foreach_mul_(tensors, scale)
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        bucket, size = [], 0
        for t in same + [None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= COALESCE_BUCKET_BYTES):
                flat = _flatten_dense_tensors(bucket)
                all_reduce_sum_(flat, group)
                if scale is not None:
                    flat.mul_(scale)
                for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    dst.copy_(src)
                bucket, size = [], 0
