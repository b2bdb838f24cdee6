"""Slow-rank detector on jobs it was not tuned on: false alarms and recall.

    python benchmarks/detector_sweep.py --healthy 100 --injected 100 --seed 7
    python benchmarks/detector_sweep.py --healthy 4 --injected 4 --keep DIR   # keep traces
    python benchmarks/detector_sweep.py --from DIR                             # re-detect

Every trial is a 4-rank GPT run (`examples/pretrain_gpt.py --trace`, Gloo) of a
configuration drawn at random: hidden 64-512, sequence 32-512, layers 2-6,
heads 2-8, micro-batch 1-2, every 4-rank layout (DP4, TP4, TP2xDP2 with and
without SP, TP2xPP2, PP2xDP2 1F1B / interleaved / zero-bubble, PP4, DP4 ZeRO-1),
gradient compression none / int8 / PowerSGD, memory pool on or off. Healthy
trials inject nothing; injected trials slow a random rank's forward or backward
by a factor in `--factors` (MAPP_INJECT_SLOWDOWN). The detector (defaults,
nothing tuned per trial) reads each run's traces after its first
`--warmup` iterations.

Reported: false-positive rate on healthy runs (any rank named), recall per
factor (the injected rank named first), wrong-rank rate, and how often the
detector answered "not enough evidence".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

# name -> (flags, tp, pp, vpp)
LAYOUTS = {
    "dp4": ([], 1, 1, 1),
    "dp4-zero1": (["--use-distributed-optimizer"], 1, 1, 1),
    "tp4": (["--tensor-model-parallel-size", "4"], 4, 1, 1),
    "tp2xdp2": (["--tensor-model-parallel-size", "2"], 2, 1, 1),
    "tp2-spxdp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1, 1),
    "tp2xpp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                2, 2, 1),
    "pp2xdp2": (["--pipeline-model-parallel-size", "2"], 1, 2, 1),
    "pp2xdp2-vp2": (["--pipeline-model-parallel-size", "2",
                     "--virtual-pipeline-model-parallel-size", "2"], 1, 2, 2),
    "pp2xdp2-zb": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                    "zero-bubble"], 1, 2, 1),
    "pp4": (["--pipeline-model-parallel-size", "4"], 1, 4, 1),
}
#: Layouts where some rank has no peer doing the same work (PP4: every stage
#: differs); a slowdown there from the first iteration cannot be told from the
#: stage's own cost, only a change against its history (online detection).
NO_PEERS = ("pp4",)
CODECS = {"none": [], "int8": ["--grad-compression", "int8"],
          "powersgd": ["--grad-compression", "powersgd:2"]}


def draw(rng: random.Random, peers_only: bool = False) -> dict:
    while True:
        name = rng.choice(sorted(LAYOUTS))
        if peers_only and name in NO_PEERS:
            continue
        flags, tp, pp, vpp = LAYOUTS[name]
        layers = rng.randint(2, 6)
        if layers % (pp * vpp):
            continue
        heads = rng.choice([h for h in (2, 4, 8) if h % tp == 0] or [tp])
        hidden = rng.choice([h for h in (64, 96, 128, 192, 256, 320, 384, 448, 512)
                             if h % heads == 0])
        seq = rng.choice([32, 64, 96, 128, 192, 256, 384, 512])
        mbs = rng.choice([1, 2])
        dp = 4 // (tp * pp)
        micro = 4 if pp > 1 else rng.choice([1, 2])
        codec = rng.choice(sorted(CODECS)) if dp > 1 else "none"
        return {"layout": name, "layers": layers, "heads": heads, "hidden": hidden, "seq": seq,
                "mbs": mbs, "gbs": mbs * dp * micro, "codec": codec,
                "pool": rng.random() < 0.5}


def trial_flags(cfg: dict, iters: int, out: str) -> list:
    """pretrain_gpt.py's command line for one trial."""
    flags = ["--num-layers", str(cfg["layers"]), "--hidden-size", str(cfg["hidden"]),
             "--num-attention-heads", str(cfg["heads"]), "--seq-length", str(cfg["seq"]),
             "--micro-batch-size", str(cfg["mbs"]), "--global-batch-size", str(cfg["gbs"]),
             "--train-iters", str(iters), "--eval-iters", "0", "--eval-interval", "0",
             "--no-progress", "--log-interval", "100000", "--output-dir", out,
             "--trace", "--trace-dir", os.path.join(out, "trace"),
             *LAYOUTS[cfg["layout"]][0], *CODECS[cfg["codec"]]]
    if cfg["pool"]:
        flags.append("--memory-pool")
    return flags


def command(cfg: dict, iters: int, out: str, port: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            os.path.join(ROOT, "examples", "pretrain_gpt.py"), *trial_flags(cfg, iters, out)]


def _inject_env(inject: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAPP_INJECT_SLOWDOWN", "MAPP_INJECT_LINK_DELAY")}
    env["OMP_NUM_THREADS"] = "1"
    if inject:
        env["MAPP_INJECT_SLOWDOWN"] = (f"rank={inject['rank']},factor={inject['factor']},"
                                       f"phase={inject['phase']}")
    return env


def run_trial(cfg: dict, inject: dict | None, iters: int, out: str) -> float:
    """One trial launched by torchrun, as a user launches a job."""
    from dist_harness import free_port

    t0 = time.perf_counter()
    p = subprocess.run(command(cfg, iters, out, free_port()), env=_inject_env(inject),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode:
        raise RuntimeError(f"trial {cfg} failed:\n{p.stdout[-3000:]}")
    return time.perf_counter() - t0


def _trial_body(rank, world, flags):
    from megatronapp.pretrain import build_parser, train

    train(build_parser().parse_args(flags))


def run_trial_warm(cfg: dict, inject: dict | None, iters: int, out: str) -> float:
    """One trial on the test harness's warm rank processes (tests/python/
    dist_harness.py): the same training and traces without a launch per
    trial. The ranks take this process's environment, so the injection is set
    here for the duration of the trial."""
    from dist_harness import run_ranks

    keys = ("MAPP_INJECT_SLOWDOWN", "MAPP_INJECT_LINK_DELAY", "OMP_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in keys}
    env = _inject_env(inject)
    for k in keys:
        os.environ.pop(k, None)
        if k in env:
            os.environ[k] = env[k]
    try:
        t0 = time.perf_counter()
        run_ranks(_trial_body, 4, trial_flags(cfg, iters, out), timeout=600)
        return time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def judge(trace_dir: str, iters: int, warmup: int) -> dict:
    from megatronapp.trace.detect import detect_dir

    return detect_dir(trace_dir, iterations=range(warmup, iters))  # traced iterations count from 0


def summarize(results: list, factors: list) -> dict:
    healthy = [r for r in results if r["inject"] is None]
    out = {"healthy_runs": len(healthy),
           "false_positives": sum(r["named"] is not None for r in healthy),
           "healthy_inconclusive": sum(r["verdict"] == "insufficient" for r in healthy)}
    out["false_positive_rate"] = out["false_positives"] / max(1, len(healthy))
    for f in sorted(set(factors)):
        rs = [r for r in results if r["inject"] and r["inject"]["factor"] == f]
        if not rs:
            continue
        out[f"{f}x"] = {"runs": len(rs),
                        "recall": sum(r["named"] == r["inject"]["rank"] for r in rs) / len(rs),
                        "wrong_rank": sum(r["named"] not in (None, r["inject"]["rank"])
                                          for r in rs),
                        "inconclusive": sum(r["verdict"] == "insufficient" for r in rs)}
    return out


def sweep(healthy: int, injected: int, factors: list, *, iters: int = 12, warmup: int = 1,
          seed: int = 7, keep: str | None = None, warm: bool = False) -> tuple[dict, list]:
    """Runs the trials; returns (summary, per-trial results). warm: on the
    test harness's warm ranks instead of a torchrun launch per trial."""
    rng = random.Random(seed)
    plan = [None] * healthy
    for i in range(injected):
        plan.append({"rank": rng.randrange(4), "phase": rng.choice(["forward", "backward"]),
                     "factor": factors[i % len(factors)]})
    rng.shuffle(plan)
    root = keep or tempfile.mkdtemp(prefix="mapp_detector_sweep_")
    os.makedirs(root, exist_ok=True)
    trial = run_trial_warm if warm else run_trial
    results = []
    try:
        for i, inject in enumerate(plan):
            cfg = draw(rng, peers_only=inject is not None)
            d = os.path.join(root, f"trial{i:04d}")
            secs = trial(cfg, inject, iters, d)
            t = {"config": cfg, "inject": inject, "iters": iters, "secs": round(secs, 1)}
            with open(os.path.join(d, "trial.json"), "w") as f:
                json.dump(t, f)
            rep = judge(os.path.join(d, "trace"), iters, warmup)
            results.append({**t, **_verdict(rep)})
            _print(i, results[-1])
            if not keep:
                shutil.rmtree(d, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return summarize(results, factors), results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--healthy", type=int, default=100)
    ap.add_argument("--injected", type=int, default=100)
    ap.add_argument("--factors", default="1.2,1.5,1.5,2.0",
                    help="cycled over the injected trials (1.5 twice: the goal's factor)")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=1, help="iterations left out of decisions")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep", default=None, help="keep every trial's traces under this folder")
    ap.add_argument("--from", dest="src", default=None,
                    help="re-run the detector on a folder written by --keep")
    ap.add_argument("--warm-ranks", action="store_true",
                    help="run the trials on warm rank processes (the test harness's) "
                         "instead of one torchrun launch each")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    if args.src:
        results = []
        for name in sorted(os.listdir(args.src)):
            d = os.path.join(args.src, name)
            if not os.path.isfile(os.path.join(d, "trial.json")):
                continue
            with open(os.path.join(d, "trial.json")) as f:
                t = json.load(f)
            rep = judge(os.path.join(d, "trace"), t["iters"], args.warmup)
            results.append({**t, **_verdict(rep)})
            _print(len(results) - 1, results[-1])
        summary = summarize(results, factors)
    else:
        summary, results = sweep(args.healthy, args.injected, factors, iters=args.iters,
                                 warmup=args.warmup, seed=args.seed, keep=args.keep,
                                 warm=args.warm_ranks)
    print("summary:", json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "trials": results}, f, indent=1)


def _verdict(rep: dict) -> dict:
    top = rep["suspects"][0] if rep["suspects"] else None
    best = rep["all"][0] if rep["all"] else {}
    return {"verdict": rep.get("verdict"), "named": top["rank"] if top else None,
            "named_cause": top["cause"] if top else None,
            "top_rank": best.get("rank"), "top_cause": best.get("cause"),
            "top_score": best.get("score"), "top_confidence": best.get("confidence")}


def _print(i: int, r: dict) -> None:
    c, inj = r["config"], r["inject"]
    what = "healthy" if inj is None else f"{inj['factor']}x r{inj['rank']} {inj['phase']}"
    ok = (r["named"] is None) if inj is None else (r["named"] == inj["rank"])
    print(f"{i:4d} {'ok ' if ok else 'BAD'} {c['layout']:12s} h{c['hidden']} s{c['seq']} "
          f"l{c['layers']} {c['codec']:8s} pool={int(c['pool'])} {what:22s} -> "
          f"{r['verdict']} named {r['named']} ({r['named_cause']}); top r{r['top_rank']} "
          f"score {r['top_score']} conf {r['top_confidence']} [{r.get('secs', '')}s]", flush=True)


if __name__ == "__main__":
    main()
