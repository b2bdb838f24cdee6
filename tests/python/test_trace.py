"""Tracing: alignment against synthetic clocks, tolerant loading, merged
output well-formed, and slow-rank detection on real 4-rank runs with injected
faults (TP2 x DP2 and PP2 x DP2)."""

import json
import os
import sys

import numpy as np
import pytest

from dist_harness import run_ranks

MODEL = ["--num-layers", "2", "--hidden-size", "192", "--num-attention-heads", "4",
         "--seq-length", "192", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "20", "--eval-iters", "1", "--no-progress", "--log-interval", "1000"]
# 20 iterations: the detector's t-test over iterations needs about that many to
# decide at 1% error probability when 4 ranks share 2 cores (8 left healthy
# noise and a 1.5x slowdown "insufficient" in about 1 run of 10).


def _traced_run(rank, world, extra, out_dir, env):
    os.environ.update(env)
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(MODEL + extra + ["--output-dir", out_dir, "--trace",
                                                      "--trace-dir", out_dir + "/trace"])
    return train(args).get("trace")


def test_alignment_recovers_offsets_and_drift_within_5us():
    from megatronapp.trace.aggregate import align, apply_alignment

    rng = np.random.default_rng(0)
    hosts = {0: "a", 1: "a", 2: "b", 3: "c"}
    truth = {"a": (0.0, 0.0), "b": (1834.5, 23e-6), "c": (-912.25, -17e-6)}  # offset us, drift
    t0 = 5e6
    events = {r: [] for r in hosts}
    groups = [("tp0", [0, 1]), ("dp", [0, 2]), ("dp2", [1, 3]), ("all", [0, 1, 2, 3])]
    for k in range(300):
        true_end = t0 + k * 3.3e4 + rng.uniform(0, 100)
        name, members = groups[k % len(groups)]
        for r in members:
            a, b = truth[hosts[r]]
            # local time such that local + a + b (local - t0) == true (+ noise)
            noise = rng.normal(0, 0.5) + (rng.exponential(300) if rng.random() < 0.1 else 0.0)
            local_end = (true_end + noise - a + b * t0) / (1 + b)
            events[r].append({"ph": "X", "ts": local_end - 50, "dur": 50.0, "pid": r, "tid": 1,
                              "name": "all_reduce", "cat": "collective",
                              "args": {"group": name, "seq": k, "iter": 0}})
    al = align(events, hosts)
    fixed = apply_alignment(events, al)
    for r in hosts:
        for e_local, e_fixed in zip(events[r][::37], fixed[r][::37], strict=True):
            a, b = truth[hosts[r]]
            end = e_local["ts"] + e_local["dur"]
            want = end + a + b * (end - t0)
            got = e_fixed["ts"] + e_fixed["dur"]
            assert abs(got - want) < 5.0, (r, got - want)
    assert al["domains"] == 3


def test_loading_tolerates_a_dead_writer_and_rejects_garbage(tmp_path):
    from megatronapp.trace.aggregate import load_trace

    good = '[\n{"ph":"M","pid":0,"name":"process_name","args":{"name":"rank 0"}},\n' \
           '{"ph":"X","pid":0,"tid":0,"name":"F","cat":"compute","ts":1.5,"dur":2.0,"args":{}},\n'
    (tmp_path / "a.json").write_text(good + '{"ph":"X","pid":0,"ti')  # torn last line
    assert [e["ph"] for e in load_trace(str(tmp_path / "a.json"))] == ["M", "X"]
    for text, msg in [("{}", "not a Chrome trace"), ("[\n{\"x\": 1}\n]", "no 'ph'|'ph' field"),
                      ('[{"ph":"X","pid":0,"tid":0,"name":"F","ts":"a","dur":1}]', "non-numeric"),
                      ('[{"ph":"X","pid":0,"name":"F","ts":1,"dur":1}]', "lacks 'tid'"),
                      ("[\n{,\n]", "malformed trace JSON")]:
        (tmp_path / "b.json").write_text(text)
        with pytest.raises(ValueError, match=msg):
            load_trace(str(tmp_path / "b.json"))


def _synthetic(n_iters, mbs, slow=None, noise=0.08, seed=0, pp=None, world=4):
    """Compute events of `world` ranks: forward/backward per microbatch, busy
    time log-normal around 10/20 ms; `slow` = (rank, op, factor[, from iter])."""
    rng = np.random.default_rng(seed)
    events = {r: [] for r in range(world)}
    meta = {r: {"pp": (pp or {}).get(r, 0)} for r in range(world)}
    t = 0.0
    for it in range(n_iters):
        for mb in range(mbs):
            for name, base in (("forward", 10e3), ("backward", 20e3)):
                for r in range(world):
                    us = base * float(np.exp(rng.normal(0, noise)))
                    if slow and r == slow[0] and name == slow[1] and it >= (slow[3:] or (0,))[0]:
                        us *= slow[2]
                    events[r].append({"ph": "X", "ts": t, "dur": us, "pid": r, "tid": 0,
                                      "name": name, "cat": "compute",
                                      "args": {"iter": it, "mb": mb, "chunk": 0, "busy_us": us}})
                t += 50e3
    return events, meta


def test_detector_decides_with_confidence_on_synthetic_peers():
    from megatronapp.trace.detect import detect

    # Healthy with 8% noise, many seeds: never names anyone.
    for seed in range(20):
        rep = detect(*_synthetic(10, 2, seed=seed))
        assert rep["verdict"] == "healthy" and rep["suspects"] == [], rep["suspects"]
    # 1.5x backward on rank 2: named first, with its cause and a high confidence.
    rep = detect(*_synthetic(10, 2, slow=(2, "backward", 1.5)))
    assert rep["verdict"] == "slow" and [s["rank"] for s in rep["suspects"]] == [2]
    assert rep["suspects"][0]["cause"] == "compute (backward)"
    assert rep["suspects"][0]["confidence"] > 0.999 and 0.4 < rep["suspects"][0]["score"] < 0.6
    # Consistently 8% slower: real, measured, but below the 10% worth naming.
    rep = detect(*_synthetic(10, 2, slow=(1, "forward", 1.08), noise=0.005))
    assert rep["suspects"] == [] and rep["verdict"] == "healthy"
    assert rep["all"][0]["rank"] == 1 and abs(rep["all"][0]["score"] - 0.08) < 0.01
    # A rank slower in half the iterations only (a noisy neighbour, not a slow
    # device): suspicious, not proven.
    events, meta = _synthetic(10, 2, noise=0.02)
    for e in events[3]:
        if e["args"]["iter"] % 2 and e["name"] == "forward":
            e["args"]["busy_us"] *= 1.6
    rep = detect(events, meta)
    assert rep["suspects"] == [] and rep["verdict"] == "insufficient", rep["tests"]
    # Two instances cannot prove anything: "insufficient", not a guess.
    rep = detect(*_synthetic(1, 2, slow=(3, "forward", 2.0)))
    assert rep["verdict"] == "insufficient" and rep["suspects"] == []
    # PP4 (no peer does the same work): insufficient without history...
    pp4 = {0: 0, 1: 1, 2: 2, 3: 3}
    rep = detect(*_synthetic(10, 4, slow=(2, "forward", 1.5), pp=pp4))
    assert rep["verdict"] == "insufficient" and rep["unexamined_ranks"] == [0, 1, 2, 3]


def test_detector_compares_a_rank_with_its_own_history():
    from megatronapp.trace.detect import baseline, detect

    pp4 = {0: 0, 1: 1, 2: 2, 3: 3}
    events, meta = _synthetic(16, 4, slow=(2, "forward", 1.5, 8), pp=pp4)
    first = {r: [e for e in ev if e["args"]["iter"] < 8] for r, ev in events.items()}
    later = {r: [e for e in ev if e["args"]["iter"] >= 8] for r, ev in events.items()}
    rep = detect(first, meta)
    assert rep["suspects"] == []
    history = baseline(first)
    rep = detect(later, meta, history=history)
    assert [s["rank"] for s in rep["suspects"]] == [2], rep["tests"]
    assert rep["suspects"][0]["cause"] == "compute (forward, against its history)"
    # The same ranks unchanged against their history: nobody named.
    events, meta = _synthetic(16, 4, pp=pp4, seed=3)
    rep = detect({r: [e for e in ev if e["args"]["iter"] >= 8] for r, ev in events.items()},
                 meta, history=baseline({r: [e for e in ev if e["args"]["iter"] < 8]
                                         for r, ev in events.items()}))
    assert rep["suspects"] == [] and rep["verdict"] == "healthy"


def _check_well_formed(merged_path):
    with open(merged_path) as f:
        data = json.load(f)
    spans = {}
    for e in data["traceEvents"]:
        assert "ph" in e and "pid" in e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and "tid" in e
            spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    # Per (rank, lane) events nest or are disjoint: never a partial overlap.
    for key, s in spans.items():
        s.sort(key=lambda x: (x[0], -x[1]))
        stack = []
        for lo, hi in s:
            while stack and stack[-1] <= lo + 1e-3:
                stack.pop()
            assert not stack or hi <= stack[-1] + 1e-3, (key, lo, hi, stack[-1])
            stack.append(hi)
    return data


SCENARIOS = [
    ("tp2dp2-healthy", ["--tensor-model-parallel-size", "2"], {}, None),
    ("tp2dp2-forward", ["--tensor-model-parallel-size", "2"],
     {"MAPP_INJECT_SLOWDOWN": "rank=1,factor=1.5,phase=forward"}, 1),
    ("tp2dp2-backward", ["--tensor-model-parallel-size", "2"],
     {"MAPP_INJECT_SLOWDOWN": "rank=2,factor=1.5,phase=backward"}, 2),
    ("pp2dp2-healthy", ["--pipeline-model-parallel-size", "2"], {}, None),
    ("pp2dp2-forward", ["--pipeline-model-parallel-size", "2"],
     {"MAPP_INJECT_SLOWDOWN": "rank=3,factor=1.5,phase=forward"}, 3),
    ("pp2dp2-backward", ["--pipeline-model-parallel-size", "2"],
     {"MAPP_INJECT_SLOWDOWN": "rank=1,factor=1.5,phase=backward"}, 1),
    ("pp2dp2-link", ["--pipeline-model-parallel-size", "2"],
     {"MAPP_INJECT_LINK_DELAY": "rank=0,peer=2,ms=6"}, 0),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,extra,env,culprit", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_detector_names_the_injected_rank(tmp_path, name, extra, env, culprit):
    from megatronapp.trace.__main__ import main as cli
    from megatronapp.trace.detect import detect_dir

    stats = run_ranks(_traced_run, 4, extra, str(tmp_path), env)
    assert all(s["events"] > 0 and s["dropped"] == 0 for s in stats)
    trace_dir = str(tmp_path / "trace")
    assert cli(["aggregate", trace_dir, "-o", str(tmp_path / "merged.json"), "--detect",
                "--report", str(tmp_path / "report.json")]) == 0
    data = _check_well_formed(tmp_path / "merged.json")
    if "pp2" in name:  # P2P sends linked to their receives
        assert any(e["ph"] == "s" for e in data["traceEvents"])
    report = detect_dir(trace_dir)
    names = [s["rank"] for s in report["suspects"]]
    if culprit is None:
        assert names == [], report["suspects"]
    else:
        assert names and names[0] == culprit, report["all"]
        want = "link" if "link" in name else "compute"
        assert report["suspects"][0]["cause"].startswith(want)
    # Volume: at most 50 KB per rank per traced iteration.
    for r in range(4):
        size = os.path.getsize(os.path.join(trace_dir, f"trace.rank{r}.json"))
        assert size / 20 < 50_000, size


@pytest.mark.timeout(600)
def test_online_detection_warns_during_training(tmp_path):
    # factor 2 (was 1.5): a 10-iteration window of 1.5x was "not enough
    # evidence" once in a full suite (2026-12-07); the detector's sensitivity
    # to small slowdowns is the sweep's and the scenarios' subject.
    env = {"MAPP_INJECT_SLOWDOWN": "rank=1,factor=2.0,phase=backward"}
    stats = run_ranks(_traced_run, 4, ["--tensor-model-parallel-size", "2",
                                       "--trace-detect-interval", "10"], str(tmp_path), env)
    reports = stats[0]["detections"]
    assert [r["iterations"] for r in reports] == [list(range(10)), list(range(10, 20))]
    # The first window holds the first iterations' one-time costs: there the
    # detector may answer "not enough evidence" (seen once in a full suite on
    # warm ranks), never another rank; the second window must name rank 1.
    for r in reports:
        if not r["suspects"]:
            assert r is reports[0] and r["verdict"] == "insufficient", reports
            continue
        assert r["suspects"][0]["rank"] == 1, reports
        assert r["suspects"][0]["cause"] == "compute (backward)"
    assert reports[1]["suspects"], reports


@pytest.mark.timeout(600)
def test_online_detection_names_a_rank_that_slows_mid_run_without_peers(tmp_path):
    """PP4: no rank has a peer doing the same work; the slowdown starts at
    iteration 15, and the second window compares rank 2 with its own first."""
    env = {"MAPP_INJECT_SLOWDOWN": "rank=2,factor=2.0,phase=forward,start=15"}
    model = ["--num-layers", "4", "--pipeline-model-parallel-size", "4",
             "--trace-detect-interval", "15", "--train-iters", "30"]
    stats = run_ranks(_traced_run, 4, model, str(tmp_path), env)
    reports = stats[0]["detections"]
    assert [r["iterations"][0] for r in reports] == [0, 15], reports
    assert reports[0]["suspects"] == [] and reports[0]["verdict"] == "insufficient"
    assert reports[1]["suspects"] and reports[1]["suspects"][0]["rank"] == 2, reports
    assert "history" in reports[1]["suspects"][0]["cause"]


def test_sampling_traces_k_of_every_n_iterations(tmp_path):
    from megatronapp.trace.aggregate import load_trace

    run_ranks(_traced_run, 2, ["--tensor-model-parallel-size", "2", "--trace-interval", "4",
                               "--trace-iterations", "1", "--trace-granularity", "coarse",
                               "--train-iters", "8"],
              str(tmp_path), {})
    events = load_trace(str(tmp_path / "trace" / "trace.rank0.json"))
    iters = {e["args"]["iter"] for e in events if e["ph"] == "X"}
    assert iters == {0, 4}
    cats = {e["cat"] for e in events if e["ph"] == "X"}
    assert "compute" not in cats and "collective" in cats and "iteration" in cats


def _x(name, cat, ts, dur, tid=0):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": {"iter": 0}}


def test_phase_breakdown_of_a_synthetic_iteration():
    """One 100 us iteration: data 5, forward 30 with a 10 us TP all-reduce in
    it, a 12 us receive wait, backward 20, a 8 us DP wait, optimizer 15; a send
    on the comm lane (2) is not the training thread's time. Rest = other."""
    from megatronapp.trace.phases import breakdown

    events = [_x("iteration", "iteration", 0, 100), _x("data", "data", 0, 5),
              _x("forward", "compute", 5, 30), _x("tp_all_reduce", "collective", 15, 10),
              _x("recv_wait", "p2p", 35, 12), _x("backward", "compute", 47, 20),
              _x("send", "p2p", 50, 40, tid=2), _x("dp_wait", "collective", 67, 8),
              _x("optimizer", "optimizer", 75, 15)]
    row = breakdown({0: events})[0]
    want = {"compute": 0.040, "tp_collective": 0.010, "p2p_wait": 0.012, "dp_wait": 0.008,
            "optimizer": 0.015, "data": 0.005, "other": 0.010, "iteration": 0.100}
    for k, v in want.items():
        assert row[k] == pytest.approx(v), (k, row[k], v)


def test_phase_breakdown_of_a_real_pipeline_run(tmp_path):
    """TP2 x PP2 zero-bubble: on every rank the phases cover the iteration,
    compute is the largest part, and the pipeline's ranks wait on receives."""
    from megatronapp.trace.__main__ import main as trace_main
    from megatronapp.trace.phases import PHASES, breakdown_dir

    run_ranks(_traced_run, 4, ["--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2",
                               "--pipeline-schedule", "zero-bubble", "--train-iters", "8"],
             str(tmp_path), {})
    result = breakdown_dir(str(tmp_path / "trace"))
    assert sorted(result) == [0, 1, 2, 3]
    for rank, row in result.items():
        assert row["iterations"] == 8
        assert sum(row[p] for p in PHASES) == pytest.approx(row["iteration"], rel=0.05), row
        assert row["compute"] > 0.3 * row["iteration"], (rank, row)
        assert row["p2p_wait"] > 0, (rank, row)
    assert trace_main(["phases", str(tmp_path / "trace"), "--skip", "1", "--json",
                       str(tmp_path / "phases.json")]) == 0
    assert json.load(open(tmp_path / "phases.json"))["0"]["iterations"] == 7


@pytest.mark.timeout(900)
def test_detector_sweep_short_version(capsys):
    """The false-alarm benchmark in small: random configurations (seed fixed
    here, different from the benchmark's), one healthy run and one with a
    1.5x and one with a 2x slowdown of a random rank and phase. The trials
    run on warm ranks (benchmarks/detector_sweep.py --warm-ranks); the
    benchmark launches each with torchrun."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmarks"))  # the ranks import it from there too
    try:
        import detector_sweep

        summary, _ = detector_sweep.sweep(1, 2, [1.5, 2.0], seed=101, warm=True)
    finally:
        sys.path.remove(os.path.join(root, "benchmarks"))
    log = capsys.readouterr().out
    assert summary["false_positives"] == 0, log
    for f in ("1.5x", "2.0x"):
        assert summary[f]["recall"] == 1.0 and summary[f]["wrong_rank"] == 0, log
