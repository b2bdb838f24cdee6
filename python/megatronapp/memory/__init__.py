"""The dynamic memory pool as PyTorch's allocator, its statistics and traces.

    import megatronapp as mapp
    mapp.memory.use_pool("cpu")        # CPU tensors come from the pool from now on
    ...train...
    print(mapp.memory.summary())
    mapp.memory.stats()["fragmentation"]

Policies: ``"ours"`` (default; expandable segments, exact splitting, see
docs/memory.md) or ``"torch-like"`` (PyTorch's caching-allocator policy
reproduced on the same machinery, for comparisons).

Planning: ``estimate(config)`` (:mod:`megatronapp.memory.plan`) says what a
run holds per rank before it runs; ``python -m megatronapp.memory estimate
<pretrain flags> [--world-size N]`` prints it.

CUDA: ``use_pool("cuda")`` installs the pool through
``torch.cuda.memory.CUDAPluggableAllocator``. It must run before the first CUDA
allocation of the process (torch cannot swap an allocator in use), and
afterwards ``torch.cuda.memory_stats()`` is unavailable — use :func:`stats`.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from .. import _C
from .plan import Breakdown, MemoryLimitError, estimate, plan_recompute

__all__ = ["use_pool", "restore_default", "stats", "summary", "release_cached",
           "staging_buffer", "staging_stats",
           "record_trace", "start_recording", "stop_recording", "replay", "is_installed",
           "reset_peak_stats", "estimate", "Breakdown", "plan_recompute", "MemoryLimitError"]



def _library_path() -> str:
    here = os.path.dirname(_C.__file__)
    return os.path.join(here, "lib", "libmegatronapp_torch.so")


def use_pool(device: str = "cpu", *, policy: str = "ours", expandable_segments: bool = True,
             gc_threshold: float = 0.0, thread_cache_bytes: int | None = None) -> None:
    """Serves `device`'s tensor allocations from the pool (process-wide).

    thread_cache_bytes (CPU only): each thread's cache of freed blocks, which
    serves same-size free+allocate pairs without the pool's lock (docs/memory.md,
    "Thread cache"). None: 1 MiB for policy "ours", none for "torch-like"; 0: off.
    """
    if not 0.0 <= gc_threshold <= 1.0:
        raise ValueError(f"gc_threshold must lie in [0, 1], got {gc_threshold}")
    if thread_cache_bytes is not None and thread_cache_bytes < 0:
        raise ValueError(f"thread_cache_bytes must be >= 0 (0 turns it off), got {thread_cache_bytes}")
    if device == "cpu":
        _C.memory_install_cpu_pool(policy, expandable_segments, gc_threshold,
                                   -1 if thread_cache_bytes is None else thread_cache_bytes)
    elif device == "cuda":
        if thread_cache_bytes:
            raise ValueError("thread_cache_bytes applies to the CPU pool only; CUDA pools serve "
                             "streams, which a per-thread cache does not track")
        if not _C.built_with_cuda():
            raise RuntimeError("megatronapp was built without CUDA; rebuild with the CUDA toolkit")
        _C.memory_configure_cuda(policy, expandable_segments, gc_threshold)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(
            _library_path(), "mapp_cuda_malloc", "mapp_cuda_free")
        try:
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as e:
            raise RuntimeError(
                "use_pool('cuda') must be called before the first CUDA allocation of the "
                f"process (torch: {e})") from e
    else:
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")


def restore_default(device: str = "cpu") -> None:
    """Puts torch's CPU allocator back (tensors from the pool stay valid)."""
    if device != "cpu":
        raise ValueError("only the CPU allocator can be restored (CUDA's swap is permanent)")
    _C.memory_restore_cpu_allocator()


def is_installed(device: str = "cpu") -> bool:
    if device == "cpu":
        return _C.memory_cpu_pool_installed()
    return _C.built_with_cuda() and _C.memory_cuda_stats_json(torch.cuda.current_device()) is not None


def stats(device: str = "cpu") -> dict:
    """allocated / active / reserved bytes with peaks, fragmentation
    (1 - peak allocated / peak reserved), alloc/free counts, cache hits,
    device allocations, OOM retries and OOMs."""
    if device == "cpu":
        return json.loads(_C.memory_cpu_stats_json())
    raw = _C.memory_cuda_stats_json(torch.cuda.current_device())
    if raw is None:
        raise RuntimeError("no CUDA pool yet: call use_pool('cuda') and allocate first")
    return json.loads(raw)


def reset_peak_stats(device: str = "cpu") -> None:
    """Peak allocated / active / reserved restart from the current values."""
    if device == "cpu":
        _C.memory_cpu_reset_peak_stats()
    else:
        _C.memory_cuda_reset_peak(torch.cuda.current_device())


def summary(device: str = "cpu") -> str:
    if device == "cpu":
        return _C.memory_cpu_summary()
    return _C.memory_cuda_summary(torch.cuda.current_device())


def release_cached(device: str = "cpu") -> None:
    """Gives cached memory back to the system (like torch.cuda.empty_cache)."""
    if device == "cpu":
        _C.memory_cpu_release_cached()
    else:
        _C.memory_cuda_release_cached(torch.cuda.current_device())


def staging_buffer(shape, dtype=torch.float32) -> torch.Tensor:
    """An uninitialized CPU tensor for host staging (communication, offload),
    from a dedicated pool: page-locked when a CUDA device is present, so
    ``.to('cuda', non_blocking=True)`` is a true asynchronous copy."""
    return torch.ops.mapp.empty_staging(list(shape), dtype)


def staging_stats() -> dict:
    return json.loads(_C.memory_staging_stats_json())


def start_recording() -> None:
    """Records every CPU-pool operation from now on (see stop_recording)."""
    _C.memory_start_cpu_trace()


def stop_recording(path: str) -> int:
    """Stops recording and writes the allocation trace; returns its event count."""
    return _C.memory_stop_cpu_trace(path)


@contextlib.contextmanager
def record_trace(path: str):
    start_recording()
    try:
        yield
    finally:
        stop_recording(path)


def replay(path: str, policy: str = "ours", *, expandable_segments: bool = True,
           capacity_bytes: int = 1 << 40, thread_cache_bytes: int | None = 0) -> dict:
    """Replays a recorded trace through a fresh pool: peak reserved,
    utilization, fragmentation and time per operation. thread_cache_bytes: 0
    (default) replays without a thread cache, as device pools run; None with the
    policy's default, as use_pool("cpu") installs it; > 0 with that size."""
    if thread_cache_bytes is not None and thread_cache_bytes < 0:
        raise ValueError(f"thread_cache_bytes must be >= 0 (0 turns it off), got {thread_cache_bytes}")
    return json.loads(_C.memory_replay(path, policy, expandable_segments, capacity_bytes,
                                       -1 if thread_cache_bytes is None else thread_cache_bytes))
