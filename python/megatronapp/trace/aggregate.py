"""Merging per-rank traces: loading, clock alignment, P2P flows.

Clock alignment: ranks on one host share its monotonic clock, so the unknowns
are per clock domain (host): ``t_true = t + a_h + b_h (t - t0)`` (offset and
drift, the first host fixed at 0). The participants of a synchronous
collective finish together, so every matched instance (same group, same
sequence number) spanning two hosts gives equations "aligned end of r ==
aligned end of the first participant"; iteratively reweighted least squares
(an L1 fit: a rank that leaves a collective late is an outlier, not a clock
error) yields (a_h, b_h); the residual (median absolute, microseconds) says
how well the model fits. Single-host runs need no correction.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

__all__ = ["load_trace", "load_dir", "align", "apply_alignment", "merge", "collective_instances",
           "clock_domains"]

_REQUIRED_X = ("ts", "dur", "pid", "tid", "name")


def load_trace(path: str) -> list:
    """Events of one rank's file; tolerates a file whose writer died (no
    closing bracket, trailing comma, a torn last line). Anything else that is
    not Trace Event JSON is a ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read trace file: {e}") from None
    stripped = text.rstrip()
    if not stripped.startswith("["):
        raise ValueError(f"{path}: not a Chrome trace (expected a JSON array starting with '[')")
    if not stripped.endswith("]"):
        # Died mid-run: keep complete lines only.
        lines = stripped.split("\n")
        while lines and not lines[-1].rstrip().endswith("},"):
            lines.pop()
        stripped = "\n".join(lines).rstrip().rstrip(",") + "\n]"
    try:
        events = json.loads(stripped)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed trace JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(events, list):
        raise ValueError(f"{path}: the top level must be a JSON array of events")
    for i, e in enumerate(events):
        if not isinstance(e, dict) or "ph" not in e:
            raise ValueError(f"{path}: event #{i} is not an object with a 'ph' field")
        if e["ph"] == "X":
            for k in _REQUIRED_X:
                if k not in e:
                    raise ValueError(f"{path}: event #{i} ({e.get('name')}) lacks '{k}'")
            if not isinstance(e["ts"], (int, float)) or not isinstance(e["dur"], (int, float)):
                raise ValueError(f"{path}: event #{i} has non-numeric ts/dur")
    return events


def load_dir(directory: str) -> tuple[dict, dict]:
    """{rank: events}, {rank: meta} of every trace.rank<R>.json in `directory`."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: no such trace directory")
    events, meta = {}, {}
    for name in sorted(os.listdir(directory)):
        m = re.fullmatch(r"trace\.rank(\d+)\.json", name)
        if not m:
            continue
        r = int(m.group(1))
        events[r] = load_trace(os.path.join(directory, name))
        mpath = os.path.join(directory, f"trace.rank{r}.meta.json")
        if os.path.exists(mpath):
            try:
                with open(mpath) as f:
                    meta[r] = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{mpath}: malformed metadata: {e.msg}") from None
        else:
            meta[r] = {"rank": r}
    if not events:
        raise ValueError(f"{directory}: no trace.rank<R>.json files (was --trace on?)")
    return events, meta


def clock_domains(meta: dict) -> dict:
    """rank -> host (ranks without a recorded host get their own domain)."""
    return {r: m.get("host", f"rank{r}") for r, m in meta.items()}


def collective_instances(events_by_rank: dict) -> dict:
    """{(group, seq): {rank: event}} of collectives with a group and sequence
    number (P2P messages excluded)."""
    out: dict = {}
    for r, events in events_by_rank.items():
        for e in events:
            a = e.get("args", {})
            if (e.get("ph") == "X" and e.get("cat") == "collective" and "seq" in a
                    and "group" in a and not str(a["group"]).startswith("p2p:")):
                out.setdefault((a["group"], a["seq"]), {})[r] = e
    return out


def align(events_by_rank: dict, domains: dict | None = None) -> dict:
    """Offsets and drifts that make matched collectives end together.
    `domains` maps rank -> clock domain (hostname; default: every rank its
    own). Returns {"ranks": {r: (a_us, b)}, "t0": us, "residual_us": median
    absolute residual, "instances": n}."""
    ranks = sorted(events_by_rank)
    dom = {r: (domains or {}).get(r, f"rank{r}") for r in ranks}
    doms = sorted(set(dom.values()), key=lambda d: min(r for r in ranks if dom[r] == d))
    ref = doms[0]
    inst = [v for v in collective_instances(events_by_rank).values()
            if len({dom[r] for r in v}) >= 2]
    result = {"ranks": {r: (0.0, 0.0) for r in ranks}, "t0": 0.0, "residual_us": 0.0,
              "instances": len(inst), "domains": len(doms)}
    if not inst:
        return result
    ends = [{r: e["ts"] + e["dur"] for r, e in v.items()} for v in inst]
    t0 = min(min(d.values()) for d in ends)
    result["t0"] = t0
    unknown = [d for d in doms if d != ref]
    col = {d: i for i, d in enumerate(unknown)}  # a at 2i, drift (ppm) at 2i+1
    rows, rhs = [], []
    for d in ends:
        items = sorted(d.items())
        p, xp = items[0][0], items[0][1] - t0
        for r, x in items[1:]:
            if dom[r] == dom[p]:
                continue
            x -= t0
            row = np.zeros(2 * len(unknown))
            if dom[r] != ref:
                row[2 * col[dom[r]]] += 1.0
                row[2 * col[dom[r]] + 1] += x * 1e-6
            if dom[p] != ref:
                row[2 * col[dom[p]]] -= 1.0
                row[2 * col[dom[p]] + 1] -= xp * 1e-6
            rows.append(row)
            rhs.append(xp - x)
    A, y = np.array(rows), np.array(rhs)
    w = np.ones(len(y))
    reg = 1e-9 * np.eye(A.shape[1])  # drift is only identifiable with a time spread
    for _ in range(30):  # IRLS towards the L1 fit
        Aw = A * w[:, None]
        sol = np.linalg.solve(A.T @ Aw + reg, Aw.T @ y)
        res = A @ sol - y
        w = 1.0 / np.maximum(np.abs(res), 1.0)
    result["residual_us"] = float(np.median(np.abs(res)))
    for r in ranks:
        if dom[r] != ref:
            i = col[dom[r]]
            result["ranks"][r] = (float(sol[2 * i]), float(sol[2 * i + 1]) * 1e-6)
    return result


def apply_alignment(events_by_rank: dict, alignment: dict) -> dict:
    """Copies of the events with aligned timestamps (durations scaled by drift)."""
    t0 = alignment["t0"]
    out = {}
    for r, events in events_by_rank.items():
        a, b = alignment["ranks"].get(r, (0.0, 0.0))
        fixed = []
        for e in events:
            if e.get("ph") == "X":
                e = dict(e)
                ts = e["ts"]
                e["ts"] = ts + a + b * (ts - t0)
                e["dur"] = e["dur"] * (1 + b)
            fixed.append(e)
        out[r] = fixed
    return out


def _flows(events_by_rank: dict) -> list:
    """Flow events linking each P2P send to the receive wait that consumed it."""
    sends, recvs = {}, {}
    for r, events in events_by_rank.items():
        for e in events:
            a = e.get("args", {})
            g = str(a.get("group", ""))
            if e.get("ph") != "X" or not g.startswith("p2p:") or e["name"] == "recv_post":
                continue
            key = (g, a.get("seq"), a.get("iter"))
            (sends if e["name"] == "send" else recvs)[key] = (r, e)
    flows = []
    for i, (key, (rs, s)) in enumerate(sorted(sends.items(), key=lambda kv: kv[1][1]["ts"])):
        if key not in recvs:
            continue
        rr, rv = recvs[key]
        common = {"cat": "p2p", "name": "p2p", "id": i}
        flows.append({**common, "ph": "s", "pid": rs, "tid": s["tid"], "ts": s["ts"]})
        flows.append({**common, "ph": "f", "bp": "e", "pid": rr, "tid": rv["tid"],
                      "ts": rv["ts"] + rv["dur"]})
    return flows


def merge(directory: str, output: str) -> dict:
    """Aligns and merges the rank files of `directory` into `output`
    (one Trace Event JSON for Perfetto); returns a summary."""
    events, meta = load_dir(directory)
    alignment = align(events, clock_domains(meta))
    aligned = apply_alignment(events, alignment)
    merged = [e for r in sorted(aligned) for e in aligned[r]]
    flows = _flows(aligned)
    with open(output, "w") as f:
        json.dump({"traceEvents": merged + flows, "displayTimeUnit": "ms",
                   "metadata": {"alignment": {str(r): v for r, v in alignment["ranks"].items()},
                                "residual_us": alignment["residual_us"]}}, f)
    return {"ranks": sorted(events), "events": sum(len(v) for v in events.values()),
            "flows": len(flows) // 2, "instances": alignment["instances"],
            "residual_us": alignment["residual_us"], "alignment": alignment, "meta": meta,
            "aligned": aligned}
