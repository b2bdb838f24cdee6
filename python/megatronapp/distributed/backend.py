"""The ``mapp`` torch.distributed backend: this node's collectives through
shared memory, Gloo for the rest, usable by any torch code.

    import megatronapp                                   # registers "mapp"
    torch.distributed.init_process_group("mapp")         # CPU tensors
    torch.distributed.init_process_group("cpu:mapp,cuda:nccl")

Every process group created on it (``new_group`` inherits the default
backend) gets a Gloo backend and, when all its members run on this node, one
shared-memory segment that carries broadcast, all_reduce (sum, avg, product,
min, max; bfloat16 too, which Gloo cannot reduce), all_gather, reduce_scatter
and all_to_all in their list, tensor and coalesced forms. Send/recv, gather,
scatter, reduce and barrier stay on Gloo, as does everything of a group that
spans nodes. ``MAPP_SHM_COLLECTIVES=0`` keeps everything on Gloo. The C++ side
is ``include/mapp/torch/backend.h``.

Megatron-Core, DeepSpeed and torch's DDP/FSDP run on it unchanged (they call
``torch.distributed``), which is how the peers benchmark gives every stack
the same transport (``benchmarks/peers/run.py --transport mapp``).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .. import _C

#: The name to pass to ``torch.distributed.init_process_group``.
BACKEND = "mapp"


def _create(options, _backend_options=None):
    timeout = options.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return _C.create_backend(options.store, options.group_rank, options.group_size, seconds,
                             str(options.group_id))


def register() -> None:
    """Registers the backend with torch.distributed (idempotent; importing
    megatronapp calls it)."""
    if BACKEND.upper() in dist.Backend._plugins:  # noqa: SLF001 (torch's registry)
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def uses_shared_memory(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` (default: the world) is on the ``mapp`` backend and
    moves its CPU collectives through shared memory."""
    import torch

    group = group or dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))  # noqa: SLF001
    except RuntimeError:
        return False
    return bool(_C.backend_uses_shared_memory(backend))
