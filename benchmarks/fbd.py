"""MegaFBD side by side: forward/backward disaggregation against 1F1B with and
without full recomputation, on the same ranks, in one run.

Every row trains the same GPT (pp = 2) on the same global batch with real
Gloo ranks, through ``megatronapp.training.train`` (the pretrain_gpt.py path)
with the memory pool on (its peak allocated bytes per rank are the memory
column). Rows:

- 4 ranks (pp 2 x dp 2): 1F1B, 1F1B + full recompute, FBD 1:1;
- 6 ranks (pp 2 x dp 3): 1F1B, 1F1B + full recompute, FBD 1:2, FBD 2:1;
- 6 ranks with the devices of data-parallel coordinate 0 (one per stage)
  1.5x slower (MAPP_INJECT_SLOWDOWN, busy-waiting like a slower device): the
  same four rows. In FBD 1:2 those two devices are exactly the forward ranks.

Each row reports the median step time after warm-up, tokens/s per rank,
the peak tensor memory of forward and backward ranks, and the simulator's
prediction of its pipeline part from the row's own measured per-action
times (1F1B rows: the C++ schedule simulator; FBD rows:
``megatronapp.pipeline.fbd.simulate``) against the measured pipeline time.
For the slow case the planner (``fbd.choose_ratio``) picks a ratio from the
homogeneous FBD 1:2 row's measured times and the 1.5x factor, before the
slow rows run; its choice is then compared with the measured rows.

    .venv/bin/python benchmarks/fbd.py            # ~6 min on 2 cores
    .venv/bin/python benchmarks/fbd.py --quick    # fewer iterations
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from dist_harness import run_ranks  # noqa: E402

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]


def _job(rank, world, flags, out, slow_ranks):
    if slow_ranks:
        os.environ["MAPP_INJECT_SLOWDOWN"] = (
            f"rank={'+'.join(map(str, slow_ranks))},factor=1.5,phase=all")
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Hook, train

    per_iter = []

    class Measure(Hook):
        def on_iteration_end(self, run, it, record):
            res = run.extra.get("pipeline_last")
            per_iter.append({"seconds": record["seconds"],
                             "pipeline": getattr(res, "step_time", None),
                             "compute": dict(getattr(res, "compute_time", {}) or {})})

        def on_start(self, run):
            self.state = run.state

    m = Measure()
    s = train(build_parser().parse_args(flags + ["--output-dir", out]), hooks=[m])
    st = m.state
    return {"rank": rank, "pp": st.pp_rank, "role": getattr(st, "fbd_role", "plain"),
            "index": getattr(st, "fbd_index", st.dp_rank), "iters": per_iter,
            "peak": s["memory"]["peak_allocated_bytes"], "loss": s["final_loss"]}


def _row(name, world, extra, args, slow_ranks=()):
    m = 4  # microbatches per data-parallel rank
    dp = world // 2
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", "8", "--seq-length", str(args.seq),
             "--micro-batch-size", "2", "--global-batch-size", str(2 * m * dp),
             "--train-iters", str(args.iters), "--lr", "1e-3", "--lr-warmup-iters", "1",
             "--eval-iters", "1", "--no-progress", "--log-interval", "1000",
             "--pipeline-model-parallel-size", "2", "--memory-pool", "--no-watchdog", *extra]
    with tempfile.TemporaryDirectory() as out:
        ranks = run_ranks(_job, world, flags, out, list(slow_ranks), timeout=900)
    warm = args.warmup
    step = statistics.median(max(r["iters"][i]["seconds"] for r in ranks)
                             for i in range(warm, args.iters))
    pipe = statistics.median(max(r["iters"][i]["pipeline"] for r in ranks)
                             for i in range(warm, args.iters))
    tokens = 2 * m * dp * args.seq
    row = {"name": name, "world": world, "step": step, "pipeline": pipe,
           "tokens_per_s_per_rank": tokens / step / world, "loss": ranks[0]["loss"]}
    for role in ("forward", "backward", "plain"):
        peaks = [r["peak"] for r in ranks if r["role"] == role]
        if peaks:
            row[f"peak_{role}_mib"] = max(peaks) / 2**20
    row["predicted_pipeline"] = _predict(ranks, extra, args, dp, m)
    row["costs"] = _costs(ranks, args)
    return row


def _mean_cost(ranks, kind, args, **match):
    vals = [statistics.fmean(it["compute"][kind] for it in r["iters"][args.warmup:]
                             if kind in it["compute"])
            for r in ranks if all(r[k] == v for k, v in match.items())
            and any(kind in it["compute"] for it in r["iters"][args.warmup:])]
    return vals


def _costs(ranks, args) -> dict:
    out = {}
    for pp in (0, 1):
        for kind in ("F", "B", "forward", "recompute", "backward"):
            vals = _mean_cost(ranks, kind, args, pp=pp)
            if vals:
                out[f"{kind}{pp}"] = max(vals)  # the slowest replica paces the step
    return out


def _predict(ranks, extra, args, dp, m) -> float:
    c = _costs(ranks, args)
    if "--forward-backward-disaggregating" in extra:
        from megatronapp.pipeline import fbd

        f, b = fbd.parse_ratio(extra[extra.index("--fbd-ratio") + 1])
        prog = fbd.program(fbd.FBDLayout(dp, f, b), 2, (f + b) * m)
        sim = fbd.simulate(prog, forward=[c.get("forward0", 0.0), 0.0],
                           recompute=[c["recompute0"], c["recompute1"]],
                           backward=[c["backward0"], c["backward1"]])
        return sim.makespan
    from megatronapp.pipeline import Schedule, simulate

    # F includes the recomputation's saving of inputs only; with full
    # recompute the executor's B includes the re-run forward.
    return simulate(Schedule.one_f_one_b(2, m), forward=[c["F0"], c["F1"]],
                    backward_input=[c["B0"], c["B1"]], backward_weight=0.0).makespan


def _slow_ranks(world):
    from megatronapp._C import Coord, RankGrid

    grid = RankGrid(world, tp=1, pp=2)
    return [grid.rank(Coord(0, 0, 0, pp)) for pp in range(2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "fbd.json"))
    args = ap.parse_args()
    if args.quick:
        args.iters, args.hidden, args.seq = 5, 128, 64
    fbd_flag = ["--forward-backward-disaggregating", "--fbd-ratio"]
    cases = {4: [("1F1B", []), ("1F1B + full recompute", RECOMPUTE),
                 ("FBD 1:1", [*fbd_flag, "1:1"])],
             6: [("1F1B", []), ("1F1B + full recompute", RECOMPUTE),
                 ("FBD 1:2", [*fbd_flag, "1:2"]), ("FBD 2:1", [*fbd_flag, "2:1"])]}
    rows = []
    for world, rs in cases.items():
        for name, extra in rs:
            rows.append(_row(name, world, extra, args))
            _print(rows[-1])
    from megatronapp.pipeline import fbd

    base = next(r for r in rows if r["name"] == "FBD 1:2")["costs"]
    plan = fbd.choose_ratio(3, 2, 12, forward=[base["forward0"], 0.0],
                            recompute=[base["recompute0"], base["recompute1"]],
                            backward=[base["backward0"], base["backward1"]],
                            forward_slowdown=1.5)
    print(f"planner (forward ranks 1.5x slower): {[(p['ratio'], round(p['makespan'], 3)) for p in plan]}",
          flush=True)
    slow = _slow_ranks(6)
    for name, extra in cases[6]:
        rows.append(_row(name + " (dp0 devices 1.5x slower)", 6, extra, args, slow))
        _print(rows[-1])
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "planner": plan}, f, indent=1)
    _table(rows, plan)


def _print(r):
    print(f"{r['world']} ranks {r['name']:<42} step {r['step'] * 1e3:8.1f} ms  pipeline "
          f"{r['pipeline'] * 1e3:8.1f} ms  predicted {r['predicted_pipeline'] * 1e3:8.1f} ms  "
          f"tok/s/rank {r['tokens_per_s_per_rank']:8.1f}", flush=True)


def _table(rows, plan):
    print("\n| ranks | configuration | step (ms) | vs 1F1B+recompute | tokens/s per rank | "
          "peak MiB fwd / bwd (or all) | pipeline measured / simulated (ms) | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = next(x for x in rows if x["world"] == r["world"]
                   and x["name"].startswith("1F1B + full recompute")
                   and ("slower" in x["name"]) == ("slower" in r["name"]))
        mem = (f"{r['peak_forward_mib']:.1f} / {r['peak_backward_mib']:.1f}"
               if "peak_forward_mib" in r else f"{r['peak_plain_mib']:.1f}")
        err = r["predicted_pipeline"] / r["pipeline"] - 1
        print(f"| {r['world']} | {r['name']} | {r['step'] * 1e3:.0f} | "
              f"{ref['step'] / r['step']:.2f}x | {r['tokens_per_s_per_rank']:.0f} | {mem} | "
              f"{r['pipeline'] * 1e3:.0f} / {r['predicted_pipeline'] * 1e3:.0f} | {err:+.0%} |")
    predicted = ", ".join(f"{p['ratio']} {p['makespan'] * 1e3:.0f} ms" for p in plan)
    print(f"\nplanner's choice for 1.5x slower forward ranks: {plan[0]['ratio']} "
          f"(predicted {predicted})")


if __name__ == "__main__":
    main()
