"""Slow-rank detection from aligned traces, as a statistical decision.

A rank slowed in backward looks normal in per-rank wall time (the gradient
all-reduce equalizes everyone), so the evidence is per op instance:

1. **Compute against peers**: the same compute op (name, iteration,
   microbatch, chunk) on ranks that run identical work (same pipeline stage),
   by device busy time when the op records it (CPU: thread CPU time, immune to
   waiting for a core), else by *exclusive* time (the op's duration minus the
   collectives / P2P waits nested in it on the same lane, so a victim waiting
   for the culprit inside a TP all-reduce does not look slow).
2. **Compute against its own history** (online detection): the rank's op times
   against its own baseline from earlier windows, for slowdowns that start
   mid-run and for ranks without peers (e.g. PP4).
3. **Links**: per P2P link, every message's transfer time (send to the end
   of the receiver's wait, when it waited) against the other links' messages
   of the same iteration (units: messages).
4. **Lateness** (reported as evidence, not scored): who enters collectives
   last.

Each (rank, op) is a hypothesis test with the *iteration* as its unit (ops of
one iteration share its noise: a core taken away, a cache thrashed): y_i is the
median log ratio of the rank's op times to its peers' in iteration i. H0 "the
rank is at most `threshold` slower" (10% by default: the smallest slowdown
worth paging someone for) is tested with a one-sided t-test of mean(y) >
log(1 + threshold), Bonferroni-corrected over every (rank, op) tested; the
corrected p-value is the decision's error probability (confidence = 1 - p). A
rank is named when the test rejects at `alpha` (0.01). A rank that looks slow
but whose iterations disagree too much (or that has fewer than 3 traced
iterations, or no peers and no history) gets the verdict ``insufficient``:
not enough evidence, never a guess.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict

from .aggregate import align, apply_alignment, clock_domains, collective_instances, load_dir

__all__ = ["detect", "detect_dir", "format_report", "baseline"]

WAIT_CATEGORIES = ("collective", "p2p")
#: Smallest median slowdown against peers (relative) for which a rank is named.
DEFAULT_THRESHOLD = 0.1
#: Family-wise error probability of naming a rank that is not slow.
DEFAULT_ALPHA = 0.01
#: A link is named when its transfers take at least this many times the others'.
LINK_FACTOR = 2.0
LINK_MIN_EXCESS_US = 1000.0


#: Fewer traced iterations than this cannot decide anything.
MIN_ITERATIONS = 3


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-12:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
           + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t > 0 else 1.0 - tail


def _one_sided_t(ys: list, null: float) -> float:
    """p-value of H0 "mean(ys) <= null" against greater (Student's t). An
    iteration hit by unrelated noise widens the spread, so it can hide a
    slow rank among too few iterations but never makes one."""
    n = len(ys)
    mean = statistics.fmean(ys)
    sd = statistics.stdev(ys)
    if sd == 0.0:
        return 0.0 if mean > null else 1.0
    return t_sf((mean - null) / (sd / math.sqrt(n)), n - 1)


def _exclusive_compute(events: list) -> list:
    """(name, iter, mb, chunk, us) of compute events, main lane."""
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
    return list(groups.values())


def baseline(events_by_rank: dict) -> dict:
    """{(rank, op name): median us} of a window judged healthy: the history
    :func:`detect` compares later windows against."""
    out = {}
    for r, events in events_by_rank.items():
        by = defaultdict(list)
        for name, _it, _mb, _ch, us in _exclusive_compute(events):
            by[name].append(us)
        for name, v in by.items():
            out[(r, name)] = statistics.median(v)
    return out


class _Tests:
    """(rank, cause) hypothesis tests on per-iteration log ratios; decides
    with Bonferroni over all of them."""

    def __init__(self):
        self.rows = []

    def add(self, rank, cause, per_iter: dict, evidence, threshold=None):
        """`per_iter`: {iteration: [log ratios of its instances]}."""
        ys = [statistics.median(v) for _, v in sorted(per_iter.items()) if v]
        self.rows.append({"rank": rank, "cause": cause, "ys": ys, "evidence": evidence,
                          "threshold": threshold})

    def decide(self, alpha, threshold):
        m = max(1, len(self.rows))
        for t in self.rows:
            thr = t["threshold"] if t["threshold"] is not None else threshold
            ys = t.pop("ys")
            t["n"] = len(ys)
            t["min_effect"] = thr
            t["effect"] = math.exp(statistics.median(ys)) - 1.0 if ys else 0.0
            t["powered"] = len(ys) >= MIN_ITERATIONS
            t["p_value"] = (min(1.0, m * _one_sided_t(ys, math.log1p(thr)))
                            if t["powered"] else 1.0)
            t["slow"] = t["p_value"] <= alpha and t["effect"] >= thr
            t["evidence"]["p_value"] = round(t["p_value"], 6)
        return self.rows


def _peer_tests(ops, meta, ranks, evidence, tests, no_evidence) -> None:
    """Compute against peers doing the same work (same pipeline stage)."""
    for group in _peer_groups(meta, ranks):
        if len(group) < 2:
            no_evidence.update(group)
            continue
        table = defaultdict(dict)  # (name, it, mb, chunk) -> {rank: us}
        for r in group:
            for name, it, mb, chunk, us in ops[r]:
                table[(name, it, mb, chunk)][r] = us
        # rank -> name -> iteration -> log ratios to the peers' median
        logr = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        sizes = defaultdict(list)
        for (name, it, *_), per_rank in table.items():
            if len(per_rank) < 2 or min(per_rank.values()) <= 0:
                continue
            sizes[name].append(len(per_rank))
            for r, us in per_rank.items():
                ref = statistics.median([v for q, v in per_rank.items() if q != r])
                logr[r][name][it].append(math.log(us / ref))
        for r in group:
            for name, per_iter in logr[r].items():
                all_r = [x for v in per_iter.values() for x in v]
                ev = {"median_ratio_to_peers": round(math.exp(statistics.median(all_r)), 3),
                      "ops": len(all_r), "iterations": len(per_iter),
                      "peers": min(sizes[name]) - 1}
                evidence[r].setdefault("compute", {})[name] = ev
                tests.add(r, f"compute ({name})", per_iter, ev)


def _history_tests(ops, ranks, history, evidence, tests, no_evidence) -> None:
    """Compute against the rank's own baseline (online detection)."""
    if history:
        for r in ranks:
            by = defaultdict(lambda: defaultdict(list))
            for name, it, _mb, _ch, us in ops[r]:
                base = history.get((r, name))
                if base and us > 0:
                    by[name][it].append(math.log(us / base))
            for name, per_iter in by.items():
                all_r = [x for v in per_iter.values() for x in v]
                ev = {"median_ratio_to_history": round(math.exp(statistics.median(all_r)), 3),
                      "ops": len(all_r), "iterations": len(per_iter)}
                evidence[r].setdefault("history", {})[name] = ev
                tests.add(r, f"compute ({name}, against its history)", per_iter, ev)
                no_evidence.discard(r)


def _link_tests(events_by_rank, evidence, tests) -> None:
    """P2P links: every message's transfer time against the other links'."""
    sends, recvs, posts = {}, {}, {}
    for events in events_by_rank.values():
        for e in events:
            a = e.get("args", {})
            g = str(a.get("group", ""))
            if e.get("ph") == "X" and g.startswith("p2p:"):
                key = (g, a.get("seq"), a.get("iter"))
                {"send": sends, "recv_post": posts}.get(e["name"], recvs)[key] = e
    per_link = defaultdict(lambda: defaultdict(list))  # link -> iter -> transfer times
    for key, s in sends.items():
        rv = recvs.get(key)
        if rv is None or rv["dur"] < 50.0:  # the receiver did not wait: arrival unseen
            continue
        start = max(s["ts"], posts[key]["ts"]) if key in posts else s["ts"]
        per_link[key[0]][key[2]].append(rv["ts"] + rv["dur"] - start)
    # Units are messages (a link delays each one; noise some): every message's
    # time against the median of the other links' messages of its iteration.
    if len(per_link) >= 2:
        for g, its in per_link.items():
            per_msg, excess = {}, []
            for it, lat in its.items():
                others = [x for h, o in per_link.items() if h != g for x in o.get(it, ())]
                ref = statistics.median(others) if others else 0.0
                for j, us in enumerate(lat):
                    if ref > 0 and us > 0:
                        per_msg[(it, j)] = [math.log(us / ref)]
                        excess.append(us - ref)
            if not per_msg:
                continue
            src = int(g[4:].split("->")[0])
            ev = {"median_ratio_to_other_links": round(math.exp(statistics.median(
                      [v[0] for v in per_msg.values()])), 3),
                  "median_excess_us": round(statistics.median(excess), 1),
                  "messages": len(per_msg)}
            evidence.setdefault(src, {}).setdefault("links", {})[g[4:]] = ev
            # A slow link costs every message a millisecond or more.
            if ev["median_excess_us"] >= LINK_MIN_EXCESS_US:
                tests.add(src, f"link {g[4:]}", per_msg, ev, threshold=LINK_FACTOR - 1.0)


def _lateness(events_by_rank, ranks, evidence) -> None:
    """Who enters collectives last (evidence only, not tested)."""
    last_count, late_sum, inst_count = defaultdict(int), defaultdict(float), defaultdict(int)
    for inst in collective_instances(events_by_rank).values():
        if len(inst) < 2:
            continue
        starts = {r: e["ts"] for r, e in inst.items()}
        first = min(starts.values())
        last_count[max(starts, key=starts.get)] += 1
        for r, t in starts.items():
            late_sum[r] += t - first
            inst_count[r] += 1
    for r in ranks:
        if inst_count[r]:
            evidence[r]["lateness"] = {"collectives": inst_count[r], "arrived_last":
                                       last_count[r], "mean_late_us":
                                       round(late_sum[r] / inst_count[r], 1)}


def detect(events_by_rank: dict, meta: dict, threshold: float = DEFAULT_THRESHOLD, *,
           alpha: float = DEFAULT_ALPHA, history: dict | None = None) -> dict:
    """`events_by_rank` must be aligned (see aggregate.align). `threshold`: the
    smallest median slowdown (relative) worth naming; `alpha`: the error
    probability allowed; `history`: :func:`baseline` of an earlier healthy
    window. Returns {"verdict": "slow" | "healthy" | "insufficient",
    "suspects" (named ranks, compute before links, largest slowdown first),
    "all", "tests", ...}."""
    ranks = sorted(events_by_rank)
    evidence = {r: {} for r in ranks}
    tests = _Tests()
    ops = {r: _exclusive_compute(events_by_rank[r]) for r in ranks}
    no_evidence = set()
    _peer_tests(ops, meta, ranks, evidence, tests, no_evidence)
    _history_tests(ops, ranks, history, evidence, tests, no_evidence)
    _link_tests(events_by_rank, evidence, tests)
    _lateness(events_by_rank, ranks, evidence)
    # decide
    rows = tests.decide(alpha, threshold)
    best = {}
    # Per rank, the cause: among its tests that name it, the op slowed most
    # (where the slowdown is: an overloaded expert slows the whole backward a
    # little, its expert compute a lot); otherwise its most significant test.
    for t in rows:
        key = (not t["slow"], -t["effect"] if t["slow"] else t["p_value"], t["p_value"])
        if t["rank"] not in best or key < best[t["rank"]][0]:
            best[t["rank"]] = (key, t)
    suspects = []
    for r in sorted(set(ranks) | set(best)):
        t = best.get(r, (None, None))[1]
        if t is None:
            suspects.append({"rank": r, "score": 0.0, "confidence": None, "p_value": None,
                             "cause": "no evidence (no peers with the same work)",
                             "slow": False, "evidence": evidence.get(r, {})})
            continue
        suspects.append({"rank": r, "score": round(t["effect"], 4),
                         "confidence": round(1.0 - t["p_value"], 6),
                         "p_value": t["p_value"], "cause": t["cause"], "slow": t["slow"],
                         "evidence": evidence.get(r, {})})
    # Compute evidence first: busy time does not wait for anyone, while a slow
    # rank delays its neighbours' messages (a link can look slow because of it).
    # Named ranks by slowdown (all passed the same error bar); the rest by p.
    suspects.sort(key=lambda s: (not s["slow"], s["cause"].startswith("link"),
                                 -s["score"] if s["slow"] else 0.0,
                                 s["p_value"] if s["p_value"] is not None else 2.0,
                                 -s["score"]))
    flagged = [s for s in suspects if s["slow"]]
    computes = [s["rank"] for s in flagged if not s["cause"].startswith("link")]
    for s in flagged:
        if s["cause"].startswith("link") and computes:
            s["note"] = (f"possibly a consequence of rank {computes[0]}'s slow compute (a slow "
                         "rank delays the messages around it)")
    # Suspicious but unprovable: an underpowered test whose effect is large, or a
    # rank with no comparison at all.
    undecided = [t for t in rows if t["effect"] >= t["min_effect"] and not t["slow"]]
    if flagged:
        verdict = "slow"
    elif undecided or no_evidence:
        verdict = "insufficient"
    else:
        verdict = "healthy"
    return {"verdict": verdict, "threshold": threshold, "alpha": alpha, "suspects": flagged,
            "all": suspects, "tests": [{k: t[k] for k in ("rank", "cause", "n", "effect",
                                                           "p_value", "powered", "slow")}
                                       for t in rows],
            "unexamined_ranks": sorted(no_evidence)}


def detect_dir(directory: str, threshold: float = DEFAULT_THRESHOLD, iterations=None, *,
               alpha: float = DEFAULT_ALPHA, history: dict | None = None,
               return_events: bool = False) -> dict:
    """Loads, aligns and runs :func:`detect` on a trace directory (optionally
    only the given iterations)."""
    events, meta = load_dir(directory)
    if iterations is not None:
        keep = set(iterations)
        events = {r: [e for e in ev if e.get("ph") != "X"
                      or e.get("args", {}).get("iter") in keep] for r, ev in events.items()}
    alignment = align(events, clock_domains(meta))
    aligned = apply_alignment(events, alignment)
    report = detect(aligned, meta, threshold, alpha=alpha, history=history)
    report["alignment_residual_us"] = alignment["residual_us"]
    if return_events:
        report["_events"] = aligned
    return report


def format_report(report: dict) -> str:
    lines = [f"slow-rank detection: {report['verdict']} (named when the slowdown is at least "
             f"{100 * report['threshold']:.0f}% at error probability {report['alpha']}):"]
    if report["verdict"] == "insufficient":
        lines.append("  not enough evidence to decide"
                     + (f" (ranks {report['unexamined_ranks']} have no peers doing the same "
                        "work; online detection compares them with their own history)"
                        if report["unexamined_ranks"] else
                        " (trace more iterations)"))
    elif not report["suspects"]:
        lines.append("  no slow rank")
    for s in report["suspects"]:
        lines.append(f"  rank {s['rank']}: {s['cause']}, {100 * s['score']:+.0f}% "
                     f"(confidence {s['confidence']:.4f})"
                     + (f"; {s['note']}" if "note" in s else ""))
        for k, v in s["evidence"].items():
            lines.append(f"      {k}: {v}")
    return "\n".join(lines)
