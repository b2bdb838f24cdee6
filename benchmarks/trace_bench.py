"""Tracing overhead, trace volume and slow-rank detection quality.

    python benchmarks/trace_bench.py                  # everything (~15 min on 2 cores)
    python benchmarks/trace_bench.py --trials 5 --skip-overhead

1. Overhead: the same 4-rank GPT run (TP2 x DP2 and PP2 x DP2) with full
   tracing and without, interleaved repeats; median per-step time (steps after
   the first two) of each.
2. Volume: trace bytes per rank per traced iteration.
3. Detection: `--trials` runs per slowdown factor (1.2, 1.5, 2.0), each with a
   random culprit rank, phase (forward / backward) and layout, plus `--trials`
   healthy runs; precision and recall of the top-ranked suspect.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "2", "--hidden-size", "192", "--num-attention-heads", "4",
         "--seq-length", "192", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--eval-iters", "1", "--no-progress", "--log-interval", "100000"]
LAYOUTS = {"tp2xdp2": ["--tensor-model-parallel-size", "2"],
           "pp2xdp2": ["--pipeline-model-parallel-size", "2"]}


def run(layout, iters, out, env=None, trace=True, port=29600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           os.path.join(ROOT, "examples", "pretrain_gpt.py"), *MODEL, *LAYOUTS[layout],
           "--train-iters", str(iters), "--output-dir", out]
    if trace:
        cmd += ["--trace", "--trace-dir", os.path.join(out, "trace")]
    e = dict(os.environ)
    for k in ("MAPP_INJECT_SLOWDOWN", "MAPP_INJECT_LINK_DELAY"):
        e.pop(k, None)
    e.update(env or {})
    subprocess.run(cmd, check=True, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "loss.csv")) as f:
        rows = f.read().strip().split("\n")[1:]
    secs = [float(r.split(",")[4]) for r in rows]
    return statistics.median(secs[2:])


def overhead(args, tmp):
    print("overhead: median step seconds, tracing off vs full, interleaved repeats")
    out = {}
    for layout in LAYOUTS:
        off, on = [], []
        for rep in range(args.repeats):
            for trace, lst in ((False, off), (True, on)) if rep % 2 == 0 else ((True, on),
                                                                                 (False, off)):
                d = os.path.join(tmp, f"ovh_{layout}_{rep}_{trace}")
                lst.append(run(layout, args.iters, d, trace=trace))
        d = os.path.join(tmp, f"ovh_{layout}_0_True", "trace")
        vol = [os.path.getsize(os.path.join(d, f"trace.rank{r}.json")) / args.iters
               for r in range(4)]
        m_off, m_on = statistics.median(off), statistics.median(on)
        out[layout] = {"off_s": m_off, "on_s": m_on, "overhead": m_on / m_off - 1,
                       "bytes_per_rank_per_iter": max(vol), "off_all": off, "on_all": on}
        print(f"  {layout}: off {m_off * 1e3:.1f} ms, on {m_on * 1e3:.1f} ms, overhead "
              f"{100 * (m_on / m_off - 1):+.1f}%, trace {max(vol) / 1e3:.1f} KB/rank/iter",
              flush=True)
    return out


def detection(args, tmp):
    from megatronapp.trace.detect import DEFAULT_THRESHOLD, detect_dir

    rng = random.Random(args.seed)
    trials = [("healthy", None)] * args.trials
    for f in (1.2, 1.5, 2.0):
        trials += [("slow", f)] * args.trials
    results = []
    for i, (kind, factor) in enumerate(trials):
        layout = rng.choice(list(LAYOUTS))
        culprit, phase, env = None, None, {}
        if kind == "slow":
            culprit, phase = rng.randrange(4), rng.choice(["forward", "backward"])
            env = {"MAPP_INJECT_SLOWDOWN": f"rank={culprit},factor={factor},phase={phase}"}
        d = os.path.join(tmp, f"det_{i}")
        run(layout, args.iters, d, env=env, port=29700 + i % 50)
        rep = detect_dir(os.path.join(d, "trace"), DEFAULT_THRESHOLD)
        top = rep["suspects"][0]["rank"] if rep["suspects"] else None
        top_score = rep["all"][0]["score"]
        results.append({"kind": kind, "factor": factor, "layout": layout, "phase": phase,
                        "culprit": culprit, "predicted": top, "top_score": top_score,
                        "top_rank": rep["all"][0]["rank"], "top_cause": rep["all"][0]["cause"],
                        "scores": {s["rank"]: s["score"] for s in rep["all"]}})
        shutil.rmtree(d, ignore_errors=True)
        print(f"  trial {i}: {kind} {factor or ''} {layout} {phase or ''} culprit {culprit} -> "
              f"{top} (top: rank {rep['all'][0]['rank']} score {top_score:.2f})", flush=True)
    summary = {}
    healthy_fp = sum(r["predicted"] is not None for r in results if r["kind"] == "healthy")
    for f in (1.2, 1.5, 2.0):
        rs = [r for r in results if r["factor"] == f]
        tp = sum(r["predicted"] == r["culprit"] for r in rs)
        wrong = sum(r["predicted"] is not None and r["predicted"] != r["culprit"] for r in rs)
        fp = wrong + healthy_fp
        summary[f] = {"recall": tp / len(rs), "precision": tp / (tp + fp) if tp + fp else 1.0,
                      "wrong_rank": wrong}
    summary["healthy_false_positives"] = healthy_fp
    summary["healthy_runs"] = args.trials
    summary["threshold"] = DEFAULT_THRESHOLD
    summary["healthy_max_score"] = max(r["top_score"] for r in results if r["kind"] == "healthy")
    print("detection:", json.dumps(summary))
    return {"summary": summary, "trials": results}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-detection", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="mapp_trace_bench_")
    out = {}
    try:
        if not args.skip_overhead:
            out["overhead"] = overhead(args, tmp)
        if not args.skip_detection:
            out["detection"] = detection(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
