"""Slow-rank detection from aligned traces.

A rank slowed in backward looks normal in per-rank wall time (the gradient
all-reduce equalizes everyone), so the evidence is:

1. **Compute**: the same compute op (name, iteration, microbatch, chunk) on
   ranks that run identical work (same pipeline stage), by *exclusive* time —
   the op's duration minus the collectives / P2P waits nested in it on the
   same lane, so a victim waiting for the culprit inside a TP all-reduce does
   not look slow; when the op records its device busy time (CPU: thread CPU
   time) that is used instead, immune to waiting for a core. Per rank and op
   name: median ratio to the other ranks' median; score = ratio - 1 of the
   worst op name among those where the rank is the slowest of its peers in
   most instances (noise makes a healthy rank slowest only by chance).
2. **Lateness**: for every collective instance (group, sequence number) on
   aligned clocks, who entered last and by how much; the culprit arrives last,
   victims wait longest.
3. **Links**: per P2P link, the time from send to the end of the receiver's
   wait (when the receiver did wait); a link's 10th percentile against the
   median link's (noise delays some messages, a slow link all of them).

Suspects above `threshold` are ranked by score with their cause and evidence.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict

import numpy as np

from .aggregate import align, apply_alignment, clock_domains, collective_instances, load_dir

__all__ = ["detect", "detect_dir", "format_report"]

WAIT_CATEGORIES = ("collective", "p2p")
#: Score (relative excess over peers) from which a rank is reported.
DEFAULT_THRESHOLD = 0.2
#: A rank's op counts as slow only when the rank is the slowest of its peers in
#: at least this share of the op's instances (and 1/peers + 0.25: chance plus a margin).
SLOWEST_SHARE = 0.5


def _exclusive_compute(events: list) -> list:
    """(name, iter, mb, chunk, exclusive_us) of compute events, main lane."""
    main = [e for e in events if e.get("ph") == "X" and e.get("tid", 0) == 0]
    waits = sorted((e["ts"], e["ts"] + e["dur"]) for e in main
                   if e.get("cat") in WAIT_CATEGORIES)
    out = []
    starts = [w[0] for w in waits]
    for e in main:
        if e.get("cat") != "compute":
            continue
        lo, hi = e["ts"], e["ts"] + e["dur"]
        nested = 0.0
        i = bisect.bisect_left(starts, lo)
        while i < len(waits) and waits[i][0] < hi:
            nested += max(0.0, min(hi, waits[i][1]) - waits[i][0])
            i += 1
        a = e.get("args", {})
        busy = a.get("busy_us")  # device busy time: exclusive by construction
        out.append((e["name"], a.get("iter"), a.get("mb", -1), a.get("chunk", -1),
                    busy if busy is not None else max(0.0, e["dur"] - nested)))
    return out


def _peer_groups(meta: dict, ranks: list) -> list:
    """Ranks that run identical compute: the same pipeline stage."""
    groups = defaultdict(list)
    for r in ranks:
        groups[meta.get(r, {}).get("pp", 0)].append(r)
    return [g for g in groups.values() if len(g) >= 2]


def detect(events_by_rank: dict, meta: dict, threshold: float = DEFAULT_THRESHOLD) -> dict:
    """`events_by_rank` must be aligned (see aggregate.align)."""
    ranks = sorted(events_by_rank)
    evidence = {r: {} for r in ranks}
    compute_score = dict.fromkeys(ranks, 0.0)
    compute_op = dict.fromkeys(ranks, None)
    # 1. compute across peers
    ops = {r: _exclusive_compute(events_by_rank[r]) for r in ranks}
    for group in _peer_groups(meta, ranks):
        table = defaultdict(dict)  # (name, it, mb, chunk) -> {rank: us}
        for r in group:
            for name, it, mb, chunk, us in ops[r]:
                table[(name, it, mb, chunk)][r] = us
        ratios = defaultdict(lambda: defaultdict(list))  # rank -> name -> ratios
        slowest = defaultdict(lambda: defaultdict(int))  # rank -> name -> times slowest
        for (name, *_), per_rank in table.items():
            if len(per_rank) < 2:
                continue
            worst = max(per_rank, key=per_rank.get)
            for r, us in per_rank.items():
                others = [v for q, v in per_rank.items() if q != r]
                ref = statistics.median(others)
                if ref > 0:
                    ratios[r][name].append(us / ref)
                    slowest[r][name] += r == worst
        for r in group:
            for name, rs in ratios[r].items():
                if len(rs) < 2:
                    continue
                score = statistics.median(rs) - 1.0
                share = slowest[r][name] / len(rs)
                evidence[r].setdefault("compute", {})[name] = {
                    "median_ratio_to_peers": round(score + 1.0, 3), "ops": len(rs),
                    "slowest_share": round(share, 3)}
                # A slow rank is the slowest of its peers most of the time; noise
                # makes a healthy one slowest about 1 / peers of the time.
                if share >= max(SLOWEST_SHARE, 1.0 / len(group) + 0.25) \
                        and score > compute_score[r]:
                    compute_score[r], compute_op[r] = score, name
    # 2. lateness into collectives
    last_count, late_sum, inst_count = (defaultdict(int), defaultdict(float), defaultdict(int))
    chance = defaultdict(float)  # expected number of last arrivals if nobody is slow
    for inst in collective_instances(events_by_rank).values():
        if len(inst) < 2:
            continue
        for r in inst:
            chance[r] += 1.0 / len(inst)
        starts = {r: e["ts"] for r, e in inst.items()}
        first = min(starts.values())
        last = max(starts, key=starts.get)
        last_count[last] += 1
        for r, t in starts.items():
            late_sum[r] += t - first
            inst_count[r] += 1
    late_score = {}
    for r in ranks:
        n = inst_count[r]
        # 0 when arriving last as often as chance, 1 when always last.
        late_score[r] = (max(0.0, last_count[r] - chance[r]) / (n - chance[r])
                         if n > chance[r] else 0.0)
        if n:
            evidence[r]["lateness"] = {"collectives": n, "arrived_last": last_count[r],
                                       "mean_late_us": round(late_sum[r] / n, 1)}
    # 3. links
    sends, recvs, posts = {}, {}, {}
    for events in events_by_rank.values():
        for e in events:
            a = e.get("args", {})
            g = str(a.get("group", ""))
            if e.get("ph") == "X" and g.startswith("p2p:"):
                key = (g, a.get("seq"), a.get("iter"))
                {"send": sends, "recv_post": posts}.get(e["name"], recvs)[key] = e
    per_link = defaultdict(list)
    for key, s in sends.items():
        rv = recvs.get(key)
        if rv is None or rv["dur"] < 50.0:  # the receiver did not wait: arrival unseen
            continue
        # The transfer starts when both the send and the receive are posted.
        start = max(s["ts"], posts[key]["ts"]) if key in posts else s["ts"]
        per_link[key[0]].append(rv["ts"] + rv["dur"] - start)
    # A slow link delays every message, noise only some: compare each link's
    # fastest tenth, not its median.
    link_med = {g: float(np.percentile(v, 10)) for g, v in per_link.items() if len(v) >= 3}
    link_score = dict.fromkeys(ranks, 0.0)
    link_name = dict.fromkeys(ranks, None)
    if len(link_med) >= 2:
        overall = statistics.median(link_med.values())
        for g, med in link_med.items():
            src = int(g[4:].split("->")[0])
            excess = med - overall
            score = med / overall - 1.0 if overall > 0 else 0.0
            if excess > 1000.0 and score > 1.0 and score > link_score.get(src, 0.0):
                link_score[src], link_name[src] = score, g[4:]
            evidence.setdefault(src, {}).setdefault("links", {})[g[4:]] = {
                "p10_us": round(med, 1), "links_median_p10_us": round(overall, 1)}
    # combine
    suspects = []
    for r in ranks:
        c, l_ = compute_score[r], link_score.get(r, 0.0)
        if c >= l_:
            score, cause = c, f"compute ({compute_op[r]})" if compute_op[r] else "compute"
        else:
            score, cause = l_, f"link {link_name[r]}"
        # Lateness corroborates: a culprit that also arrives last ranks higher.
        score += 0.1 * late_score[r] if score > 0 else 0.0
        suspects.append({"rank": r, "score": round(score, 4), "cause": cause,
                         "evidence": evidence.get(r, {})})
    suspects.sort(key=lambda s: -s["score"])
    flagged = [s for s in suspects if s["score"] >= threshold]
    return {"threshold": threshold, "suspects": flagged, "all": suspects}


def detect_dir(directory: str, threshold: float = DEFAULT_THRESHOLD, iterations=None) -> dict:
    """Loads, aligns and runs :func:`detect` on a trace directory (optionally
    only the given iterations)."""
    events, meta = load_dir(directory)
    if iterations is not None:
        keep = set(iterations)
        events = {r: [e for e in ev if e.get("ph") != "X"
                      or e.get("args", {}).get("iter") in keep] for r, ev in events.items()}
    alignment = align(events, clock_domains(meta))
    report = detect(apply_alignment(events, alignment), meta, threshold)
    report["alignment_residual_us"] = alignment["residual_us"]
    return report


def format_report(report: dict) -> str:
    lines = [f"slow-rank detection (threshold {report['threshold']}):"]
    if not report["suspects"]:
        lines.append("  no suspect above threshold")
    for s in report["suspects"]:
        lines.append(f"  rank {s['rank']}: score {s['score']:.3f}, cause {s['cause']}")
        for k, v in s["evidence"].items():
            lines.append(f"      {k}: {v}")
    return "\n".join(lines)
