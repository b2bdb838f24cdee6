"""Where the step goes: per rank, the traced iterations split into phases.

On the training thread (lane 0) every traced iteration is covered by:

* ``compute`` — forward / backward / weight-gradient actions, exclusive of
  the waits nested in them;
* ``tp_collective`` — collectives nested inside compute (tensor-parallel
  all-reduces / gathers of the layers);
* ``p2p_wait`` — waiting for a pipeline receive (the exposed part of P2P and
  the pipeline's bubbles: a stage with nothing to do waits here);
* ``dp_wait`` — collectives outside compute and the optimizer: waiting for
  the data-parallel gradient reduction (its exposed part; what overlapped with
  backward does not show) and the loss report;
* ``optimizer`` — the optimizer step with gradient finishing (norm, clipping);
* ``data`` — fetching the batch;
* ``other`` — the rest of the iteration: the executor's bookkeeping between
  actions, loss reporting, Python.

Times are means over the traced iterations (so that they add up), in
milliseconds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .aggregate import load_dir

__all__ = ["PHASES", "breakdown", "breakdown_dir", "format_breakdown"]

PHASES = ("compute", "tp_collective", "p2p_wait", "dp_wait", "optimizer", "data", "other")


def _overlap(lo: float, hi: float, spans: list) -> float:
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in spans)


def _iteration_phases(main: list, lo: float, hi: float) -> dict:
    """Phase times (us) of one iteration [lo, hi) from lane-0 events."""
    inside = [e for e in main if e["ts"] >= lo and e["ts"] + e["dur"] <= hi]
    spans = defaultdict(list)
    for e in inside:
        spans[e.get("cat", "")].append((e["ts"], e["ts"] + e["dur"]))
    out = dict.fromkeys(PHASES, 0.0)
    compute, optimizer = spans["compute"], spans["optimizer"]
    for cat in ("collective", "p2p"):
        for a, b in spans[cat]:
            if _overlap(a, b, optimizer) > 0:
                continue  # gradient finishing: part of the optimizer phase
            nested = _overlap(a, b, compute) > 0
            if cat == "collective":
                out["tp_collective" if nested else "dp_wait"] += b - a
            elif not nested:
                out["p2p_wait"] += b - a
    waits_in_compute = sum(_overlap(a, b, compute) for cat in ("collective", "p2p")
                           for a, b in spans[cat])
    out["compute"] = sum(b - a for a, b in compute) - waits_in_compute
    out["optimizer"] = sum(b - a for a, b in spans["optimizer"])
    out["data"] = sum(b - a for a, b in spans["data"])
    out["other"] = max(0.0, (hi - lo) - sum(out.values()))
    out["iteration"] = hi - lo
    return out


def breakdown(events_by_rank: dict, skip: int = 0) -> dict:
    """{rank: {phase: mean ms, "iteration": mean ms, "iterations": n}}: means,
    so that the phases add up to the iteration. ``skip``: leave out each rank's
    first traced iterations (warm-up)."""
    result = {}
    for rank, events in sorted(events_by_rank.items()):
        main = [e for e in events if e.get("ph") == "X" and e.get("tid", 0) == 0]
        iters = sorted((e for e in main if e.get("cat") == "iteration"),
                       key=lambda e: e["ts"])[skip:]
        rows = [_iteration_phases(main, e["ts"], e["ts"] + e["dur"]) for e in iters]
        if not rows:
            continue
        med = {k: statistics.fmean(r[k] for r in rows) / 1e3 for k in (*PHASES, "iteration")}
        med["iterations"] = len(rows)
        result[rank] = med
    return result


def breakdown_dir(directory: str, skip: int = 0) -> dict:
    events, _ = load_dir(directory)
    return breakdown(events, skip)


def format_breakdown(result: dict) -> str:
    lines = ["| rank | iteration ms | " + " | ".join(PHASES) + " |",
             "|---" * (len(PHASES) + 2) + "|"]
    for rank, row in result.items():
        lines.append(f"| {rank} | {row['iteration']:.1f} | "
                     + " | ".join(f"{row[p]:.1f}" for p in PHASES) + " |")
    return "\n".join(lines)
