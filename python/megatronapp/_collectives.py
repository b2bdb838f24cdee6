"""Python handles on the C++ collectives (torch.ops.mapp.*), which run on a c10d
group resolved by name. Autograd-aware wrappers live in tensor_parallel.mappings."""

from __future__ import annotations

import os
import secrets
import socket
import warnings

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


def node_identity() -> str:
    """What ranks must share to share memory: the host (name and boot), the
    /dev/shm mount, and the network namespace, which is how the benchmarks'
    emulated nodes (benchmarks/netns.py) stand apart on one machine."""
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "?"

    def inode(path):
        try:
            st = os.stat(path)
            return f"{st.st_dev}:{st.st_ino}"
        except OSError:
            return "?"

    return "|".join([socket.gethostname(), read("/proc/sys/kernel/random/boot_id"),
                     inode("/dev/shm"), inode("/proc/self/ns/net")])


def enable_shared_memory(group: dist.ProcessGroup) -> bool:
    """Moves this group's CPU collectives (all_reduce_sum_, all_gather,
    reduce_scatter_sum and the layers built on them) through one shared-memory
    segment when every member runs on this node; a no-op returning False for a
    group of one, a group spanning nodes, a non-Gloo group (NCCL has its own
    intra-node transports), or ``MAPP_SHM_COLLECTIVES=0``. Collective: every
    member must call it. If any member cannot map the segment, every member
    stays on the backend and a warning says why."""
    if group is None or group.size() == 1 or os.environ.get("MAPP_SHM_COLLECTIVES", "1") == "0":
        return False
    if dist.get_backend(group) != "gloo":
        return False
    idents: list = [None] * group.size()
    dist.all_gather_object(idents, node_identity(), group=group)
    if len(set(idents)) != 1:
        return False
    name, err = None, None
    if group.rank() == 0:
        name = f"/mapp-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            torch.ops.mapp.shm_attach(group.group_name, name, True)
        except RuntimeError as e:
            name, err = None, str(e)
    box = [name, err]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    name, err = box
    if name is not None and group.rank() != 0:
        try:
            torch.ops.mapp.shm_attach(group.group_name, name, False)
        except RuntimeError as e:
            err = str(e)
    errs: list = [None] * group.size()
    dist.all_gather_object(errs, err, group=group)  # every member has opened (or failed)
    if group.rank() == 0 and name is not None:
        torch.ops.mapp.shm_unlink(group.group_name)
    failed = [e for e in errs if e]
    if failed:
        torch.ops.mapp.shm_detach(group.group_name)
        warnings.warn(f"shared-memory collectives unavailable on group {group.group_name} "
                      f"({failed[0]}); using the Gloo backend", stacklevel=2)
        return False
    return True


def disable_shared_memory(group: dist.ProcessGroup) -> None:
    """Sends this group's collectives back to its backend (not collective)."""
    if group is not None:
        torch.ops.mapp.shm_detach(group.group_name)


def shared_memory_enabled(group: dist.ProcessGroup) -> bool:
    return group is not None and bool(torch.ops.mapp.shm_attached(group.group_name))


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
