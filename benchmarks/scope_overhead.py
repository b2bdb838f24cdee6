"""MegaScope's cost on training steps, side by side in one run.

Three configurations of the same job (2 Gloo ranks, TP2), run in rotating
order for several rounds:

- ``off``: no scope;
- ``idle``: ``--scope-port 0`` with no client (hooks installed, nothing watched);
- ``streaming``: ``--scope-port 0`` and a WebSocket client that watches a
  64-bin summary (bins over hidden) of the residual stream of every layer,
  collected to rank 0 and pushed every step.

Reported: the median iteration time of each — the step plus the scope
hook's own time around it (``scope_seconds`` in loss.csv: the command
broadcast, the collection and the push) — over the iterations after the
warm-up (for streaming, only those that streamed), the ratios to ``off``,
and the hook's own share of an iteration (a direct measurement, free of
the run-to-run noise of the ratios).
Targets (issue 22): idle <= 1% and streaming <= 10% slower.

    .venv/bin/python benchmarks/scope_overhead.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from dist_harness import free_port  # noqa: E402


def model_args(a) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", "8", "--seq-length", str(a.seq), "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", str(a.iters), "--no-progress",
            "--log-interval", "1000", "--eval-iters", "1", "--tensor-model-parallel-size", "2"]


async def _stream(port: int, first: list, stop: threading.Event) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(f"http://127.0.0.1:{port}/ws", max_msg_size=0) as ws:
            await ws.send_json({"op": "watch", "site": "residual", "bins": 64})
            async for msg in ws:
                m = json.loads(msg.data)
                if m.get("type") == "step" and m.get("internals") and not first:
                    first.append(m["iteration"])
                if stop.is_set():
                    break


def run(a, mode: str, out: str) -> dict:
    port = free_port()
    extra = [] if mode == "off" else ["--scope-port", "0"]
    procs = []
    os.makedirs(out, exist_ok=True)
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *model_args(a),
             *extra, "--output-dir", out], env=env, stdout=open(os.path.join(out, f"rank{r}.log"), "w"),
            stderr=subprocess.STDOUT))
    first, stop = [], threading.Event()
    if mode == "streaming":
        pf = os.path.join(out, "scope.port")
        while not os.path.exists(pf):
            time.sleep(0.02)
        t = threading.Thread(target=lambda: asyncio.run(_stream(int(open(pf).read()), first,
                                                                stop)), daemon=True)
        t.start()
    for p in procs:
        p.wait()
    stop.set()
    if any(p.returncode for p in procs):
        raise SystemExit(f"{mode}: training failed:\n"
                         + open(os.path.join(out, "rank0.log")).read()[-3000:]
                         + open(os.path.join(out, "rank1.log")).read()[-3000:])
    with open(os.path.join(out, "loss.csv")) as f:
        rows = list(csv.DictReader(f))
    start = max(a.warmup, first[0] if first else 0)
    # the step plus the scope hook's own time around it (loss.csv's scope_seconds)
    secs = [float(r["seconds"]) + float(r.get("scope_seconds") or 0) for r in rows
            if int(r["iteration"]) > start]
    hook = [float(r.get("scope_seconds") or 0) for r in rows if int(r["iteration"]) > start]
    if mode == "streaming" and not first:
        raise SystemExit("the streaming client never received a summary")
    return {"median": statistics.median(secs), "n": len(secs), "hook": statistics.median(hook)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    modes = ["off", "idle", "streaming"]
    times = {m: [] for m in modes}
    hooks = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            order = modes[rnd % 3:] + modes[:rnd % 3]
            for m in order:
                r = run(a, m, os.path.join(tmp, f"{m}{rnd}"))
                times[m].append(r["median"])
                hooks[m].append(r["hook"] / r["median"])
                print(f"round {rnd} {m:9s} median step {r['median'] * 1e3:7.1f} ms, of which "
                      f"the scope hook {r['hook'] * 1e3:6.2f} ms ({r['n']} iterations)",
                      flush=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"\nmodel: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, TP2 on 2 Gloo ranks; "
          f"median over {a.rounds} rounds of each run's median step")
    for m in modes:
        print(f"{m:9s} {med[m] * 1e3:7.1f} ms   x{med[m] / med['off']:.3f} of off; the hook's own "
              f"time {100 * statistics.median(hooks[m]):.2f}% of a step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "times": times, "median": med, "hook_share": hooks}, f,
                      indent=2)


if __name__ == "__main__":
    main()
