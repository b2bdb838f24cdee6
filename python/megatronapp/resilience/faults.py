"""Fault injection for tests and demos (docs/tracing.md).

The variables are declared in the tunables table (src/common/tunables.cc) and
listed by ``python -m megatronapp``; this module parses their values.

``MAPP_INJECT_SLOWDOWN="rank=1,factor=1.5,phase=forward"`` emulates a
down-clocked device on global rank 1: every transformer layer's forward
(``phase=forward``), backward (``backward``) or both (``all``) does `factor`
times its work — the layer runs, then keeps the device (here: its CPU thread)
busy for (factor - 1) x the busy time it just took before its output (or input
gradient) is released, so the busy time grows like a slower device's and the
collectives that depend on the layer are delayed accordingly.

``rank=0+2`` slows several ranks (e.g. the forward ranks of MegaFBD).
An optional ``start=K`` applies the slowdown from iteration K on (a device
that degrades mid-run; online detection compares it with its own history).

``MAPP_INJECT_KILL="rank=2,iteration=3"`` SIGKILLs global rank 2 at the start
of iteration 3 (dead-rank tests).

``MAPP_INJECT_LINK_DELAY="rank=2,peer=3,ms=5"`` delays every pipeline message
from global rank 2 to global rank 3 by 5 ms without blocking the sender (the
send is issued later from a timer thread), emulating a slow link.
"""

from __future__ import annotations

import os
import time

from .. import _C

__all__ = ["slowdown", "link_delay", "apply_slowdown", "maybe_kill"]


def _parse(var: str, keys: dict) -> dict | None:
    text = _C.tunable(var).strip()  # declared with the other tunables (python -m megatronapp)
    if not text:
        return None
    out = {}
    for part in text.split(","):
        if "=" not in part:
            raise ValueError(f"{var}='{text}': expected comma-separated key=value pairs "
                             f"with keys {sorted(keys)}")
        k, v = (x.strip() for x in part.split("=", 1))
        if k not in keys:
            raise ValueError(f"{var}: unknown key '{k}' (expected {sorted(keys)})")
        try:
            out[k] = keys[k](v)
        except ValueError:
            raise ValueError(f"{var}: bad value '{v}' for '{k}'") from None
    missing = [k for k in keys if k not in out and k not in ("phase", "start")]
    if missing:
        raise ValueError(f"{var}='{text}': missing {missing}")
    return out


def slowdown() -> dict | None:
    """The parsed MAPP_INJECT_SLOWDOWN ({"rank": int or tuple, "factor",
    "phase", "start"}), or None: parsed by the engine, which applies it to
    C++ trainers' pipeline actions (Python's trainers hook their layers)."""
    return _C.pipeline.injected_slowdown()


def link_delay() -> dict | None:
    """The parsed MAPP_INJECT_LINK_DELAY ({"rank", "peer", "ms"}), or None:
    the pipeline engine (mapp::forward_backward) reads it and delays the sends."""
    return _C.pipeline.injected_link_delay()


def expert_skew() -> dict | None:
    """The parsed MAPP_INJECT_EXPERT_SKEW ({"expert": E, "boost": B}), or None."""
    return _parse("MAPP_INJECT_EXPERT_SKEW", {"expert": int, "boost": float})


def apply_slowdown(modules, rank: int) -> bool:
    """Hooks `modules` (e.g. every transformer layer) if MAPP_INJECT_SLOWDOWN
    names `rank`. Returns whether anything was hooked."""
    spec = slowdown()
    ranks = spec["rank"] if spec is not None and isinstance(spec["rank"], tuple) else (
        spec["rank"] if spec is not None else None,)
    if spec is None or rank not in ranks or spec["factor"] == 1.0:
        return False
    extra, start = spec["factor"] - 1.0, spec["start"]
    fwd = spec["phase"] in ("forward", "all")
    bwd = spec["phase"] in ("backward", "all")
    for m in modules:
        if fwd:
            m.register_forward_pre_hook(_start_timer("_mapp_fwd_t0"))
            m.register_forward_hook(_stall("_mapp_fwd_t0", extra, start))
        if bwd:
            m.register_full_backward_pre_hook(_start_timer("_mapp_bwd_t0"))
            m.register_full_backward_hook(_stall("_mapp_bwd_t0", extra, start))
    return True


def _start_timer(attr):
    def hook(module, *_):
        setattr(module, attr, time.thread_time_ns())
    return hook


def _stall(attr, extra, start=0):
    def hook(module, *_):
        t0 = getattr(module, attr, None)
        if t0 is not None and _ITERATION["it"] >= start:
            until = time.thread_time_ns() + int(extra * (time.thread_time_ns() - t0))
            while time.thread_time_ns() < until:  # busy: the device is working
                pass
    return hook


_ITERATION = {"it": 0}


def maybe_kill(rank: int, iteration: int) -> None:
    """Called at the start of every training iteration: honours
    MAPP_INJECT_KILL and MAPP_INJECT_SLOWDOWN's ``start``."""
    _ITERATION["it"] = iteration
    spec = _parse("MAPP_INJECT_KILL", {"rank": int, "iteration": int})
    if spec is not None and spec["rank"] == rank and spec["iteration"] == iteration:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
