"""Always-on tracing and slow-rank detection.

    megatronapp.trace.start("runs/trace", interval=50, iterations=2)
    for it in range(steps):
        megatronapp.trace.begin_iteration(it)     # sampling decision
        with megatronapp.trace.scope("my_phase", mb=3):
            ...
    megatronapp.trace.stop()

    python -m megatronapp.trace aggregate runs/trace -o merged.json --detect

Each rank writes ``trace.rank<R>.json`` (Chrome Trace Event JSON, written by a
C++ background thread from a ring of fixed-size events; loadable even if the
process dies) and ``trace.rank<R>.meta.json`` (its parallel coordinates). The
C++ collectives, DP bucket reductions, the pipeline executor's actions and
transfers, and pretrain's iteration / data / forward / backward / optimizer
phases record themselves; user code adds :func:`scope`. Timestamps come from
the monotonic clock (``time.monotonic_ns`` is the C++ tracer's clock).

Sampling: iterations ``it`` with ``it % interval < iterations`` are traced
(``iterations=None``: all). Granularity ``coarse`` keeps iteration, optimizer,
data and collective events and drops per-microbatch compute and P2P events.
See docs/tracing.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from .. import _C

_tr = _C.trace

__all__ = ["start", "stop", "scope", "record", "begin_iteration", "enabled", "full",
           "active", "stats", "trace_path", "BusyTimer", "gpu_timing"]

_STATE = {"interval": 1, "iterations": None, "granularity": "full", "dir": None, "rank": 0,
          "cuda": False}


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"trace.rank{rank}.json")


def start(directory: str, rank: int | None = None, *, interval: int = 1,
          iterations: int | None = None, granularity: str = "full", metadata: dict | None = None,
          capacity: int = 1 << 16, flush_interval_ms: int = 200, device: str = "cpu") -> str:
    """Starts this rank's tracer; returns the trace file path. `metadata`
    (e.g. the rank's tp/pp/dp coordinates) goes to the sidecar meta file.
    With ``device="cuda"`` compute events get their GPU busy time from pooled
    CUDA events, resolved at the next begin_iteration (no synchronization)."""
    if interval < 1:
        raise ValueError(f"trace interval must be >= 1, got {interval}")
    if iterations is not None and not 1 <= iterations <= interval:
        raise ValueError(f"trace iterations must lie in [1, interval={interval}], got {iterations}")
    if granularity not in ("full", "coarse"):
        raise ValueError(f"trace granularity must be 'full' or 'coarse', got '{granularity}'")
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(directory, exist_ok=True)
    path = trace_path(directory, rank)
    _STATE.update(interval=interval, iterations=iterations, granularity=granularity,
                  dir=directory, rank=rank, cuda=device == "cuda" and _tr.gpu_available())
    meta = {"rank": rank, "clock": "monotonic", "host": socket.gethostname(),
            "interval": interval, "iterations": iterations,
            "granularity": granularity, **(metadata or {})}
    with open(os.path.join(directory, f"trace.rank{rank}.meta.json"), "w") as f:
        json.dump(meta, f)
    _tr.start(rank, path, capacity, flush_interval_ms, True)
    return path


def stop() -> None:
    """Resolves pending GPU timers, flushes and closes the trace file (a
    complete JSON array)."""
    if _STATE["cuda"] and _tr.active():
        import torch

        torch.cuda.synchronize()  # end of tracing, off the training path
        _tr.gpu_resolve()
    _tr.stop()


def active() -> bool:
    return _tr.active()


def enabled() -> bool:
    """True while the current iteration is being traced."""
    return _tr.enabled()


def full() -> bool:
    """True while tracing at full granularity (per-microbatch events)."""
    return _STATE["granularity"] == "full" and _tr.enabled()


def gpu_timing() -> bool:
    """True when compute events take their busy time from CUDA events
    (``start(device="cuda")`` on a build with CUDA)."""
    return bool(_STATE["cuda"])


def begin_iteration(it: int) -> bool:
    """Marks the start of iteration `it`; enables or disables recording per
    the sampling settings. Returns whether this iteration is traced."""
    if not _tr.active():
        return False
    if _STATE["cuda"]:
        _tr.gpu_resolve()  # timers of earlier iterations whose events completed
    k = _STATE["iterations"]
    on = k is None or it % _STATE["interval"] < k
    _tr.set_iteration(it)
    _tr.set_enabled(on)
    return on


def stats() -> dict:
    return dict(_tr.stats())


def flush() -> None:
    _tr.flush()


def record(name: str, category: str, start_ns: int, end_ns: int, *, lane: int = 0,
           mb: int = -1, chunk: int = -1, peer: int = -1, bytes: int = -1, group: str = "",
           seq: int = -1, busy_ns: int = -1) -> None:
    """Records one finished event (times from ``time.monotonic_ns``; `busy_ns`:
    the time the device was busy with it, e.g. ``time.thread_time_ns`` deltas)."""
    _tr.record(name, category, lane, start_ns, end_ns, mb, chunk, peer, bytes, group, seq,
               busy_ns)


class BusyTimer:
    """Busy time of one op: the thread's CPU time, or CUDA events on a GPU run
    (the event is then recorded when the GPU has finished, see start())."""

    __slots__ = ("handle", "cpu0")

    def __init__(self):
        if _STATE["cuda"]:
            self.handle, self.cpu0 = _tr.gpu_begin(), 0
        else:
            self.handle, self.cpu0 = None, time.thread_time_ns()

    def record(self, name: str, category: str, start_ns: int, end_ns: int, *, lane: int = 0,
               mb: int = -1, chunk: int = -1) -> None:
        if self.handle is not None:
            _tr.gpu_end(self.handle, name, category, lane, start_ns, end_ns, mb, chunk)
        else:
            _tr.record(name, category, lane, start_ns, end_ns, mb, chunk, -1, -1, "", -1,
                       time.thread_time_ns() - self.cpu0)


@contextlib.contextmanager
def scope(name: str, category: str = "user", *, lane: int | None = None, mb: int = -1,
          chunk: int = -1, peer: int = -1, bytes: int = -1):
    """Records the enclosed block (a no-op costing one call when not tracing).
    User scopes go to their own lane so they never overlap runtime events.
    Compute scopes also record the thread's CPU time (the busy time of a CPU
    device: waiting for a collective or for a core does not count)."""
    if not _tr.enabled() or (category in ("compute", "p2p")
                             and _STATE["granularity"] == "coarse"):
        yield
        return
    timer = BusyTimer() if category == "compute" else None
    t0 = time.monotonic_ns()
    try:
        yield
    finally:
        t1 = time.monotonic_ns()
        lane_ = (3 if category == "user" else 0) if lane is None else lane
        if timer is not None:
            timer.record(name, category, t0, t1, lane=lane_, mb=mb, chunk=chunk)
        else:
            _tr.record(name, category, lane_, t0, t1, mb, chunk, peer, bytes, "", -1, -1)
