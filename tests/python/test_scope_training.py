"""MegaScope attached to training (--scope-port): clients that connect,
stream, disconnect or misbehave leave the losses bit-identical to a run
without it; a perturbation sent mid-run changes exactly the iterations it
covers, which loss.csv marks; streamed summaries match the recorded loss."""

from __future__ import annotations

import asyncio
import base64
import csv
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from test_scope_browser import _misbehave, _post

from dist_harness import assert_no_stack_trace, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", "120", "--no-progress", "--log-interval", "50", "--eval-iters", "1",
        "--tensor-model-parallel-size", "2"]


def _train(out, extra=(), client=None, args=ARGS):
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *args, *extra,
             "--output-dir", str(out)], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    result = {}
    if client is not None:
        t = threading.Thread(target=lambda: result.update(client(out, procs)), daemon=True)
        t.start()
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    for r, log in enumerate(logs):
        assert_no_stack_trace(log, f"rank {r}")
    if client is not None:
        t.join(60)
    with open(out / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    return rows, result


def _port(out, procs):
    path = out / "scope.port"
    while not path.exists():
        assert all(p.poll() is None for p in procs), "training ended before the scope started"
        time.sleep(0.05)
    return int(path.read_text())


async def _stream(url, n):
    import aiohttp

    events = []
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(url) as ws:
            await ws.send_json({"op": "watch", "site": "residual", "bins": 64})
            await ws.send_json({"op": "watch", "site": "nope"})
            await ws.send_str("{not json")
            async for msg in ws:
                m = json.loads(msg.data)
                events.append(m)
                if sum(e.get("type") == "step" and e.get("internals") is not None
                       for e in events) >= n:
                    break  # and vanish without closing politely
    return events


def _bad_clients(out, procs):
    port = _port(out, procs)
    _misbehave("127.0.0.1", port)
    events = asyncio.run(_stream(f"http://127.0.0.1:{port}/ws", 5))
    _misbehave("127.0.0.1", port)
    return {"events": events}


def _perturber(out, procs):
    port = _port(out, procs)
    code, r = _post(f"http://127.0.0.1:{port}/api/perturb",
                    {"site": "residual", "kind": "gaussian", "layers": [0], "std": 1.0,
                     "steps": 3, "seed": 5})
    return {"code": code, "reply": r}


@pytest.mark.timeout(600)
def test_clients_never_disturb_training_and_perturbations_are_recorded(tmp_path):
    clean, _ = _train(tmp_path / "clean")
    watched, got = _train(tmp_path / "watched", ["--scope-port", "0"], _bad_clients)
    assert [r["loss"] for r in watched] == [r["loss"] for r in clean]  # bit-identical
    events = got["events"]
    replies = [e for e in events if e.get("type") == "reply"]
    assert replies[0]["watching"] == ["residual"]
    assert any("unknown site 'nope'" in e.get("error", "") for e in events)
    assert any("malformed" in e.get("error", "") or "Expecting" in e.get("error", "")
               for e in events)
    steps = [e for e in events if e.get("type") == "step" and e["internals"] is not None]
    by_iter = {int(r["iteration"]): float(r["loss"]) for r in watched}
    for e in steps:
        assert e["loss"] == by_iter[e["iteration"]]
        res = e["internals"]["residual"]
        assert sorted(res) == ["0", "1"] and res["0"]["shape"] == [64, 64]
        values = np.frombuffer(base64.b64decode(res["0"]["data"]), dtype=np.float32)
        assert values.size == 64 * 64 and np.isfinite(values).all() and values.std() > 0

    perturbed, got = _train(tmp_path / "perturbed", ["--scope-port", "0"], _perturber)
    assert got["code"] == 200, got
    marked = [int(r["iteration"]) for r in perturbed if r.get("perturbed")]
    assert len(marked) == 3 and marked == list(range(marked[0], marked[0] + 3)), marked
    assert "residual[0]:gaussian(std=1.0,seed=5)" in perturbed[marked[0] - 1]["perturbed"]
    first = marked[0] - 1
    assert [r["loss"] for r in perturbed[:first]] == [r["loss"] for r in clean[:first]]
    assert perturbed[first]["loss"] != clean[first]["loss"]


def _streamer(out, procs):
    port = _port(out, procs)
    return {"events": asyncio.run(_stream(f"http://127.0.0.1:{port}/ws", 3))}


@pytest.mark.timeout(400)
def test_pipeline_stages_stream_their_own_layers_to_rank_0(tmp_path):
    """PP2 with 1F1B and ZeRO-1: layer 0 lives on stage 0,
    layer 1 on stage 1; both reach the client, and training is unchanged."""
    args = ARGS[:ARGS.index("--tensor-model-parallel-size")] + [
        "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
        "--train-iters", "60"]  # (the last --train-iters wins)
    clean, _ = _train(tmp_path / "clean", args=args)
    watched, got = _train(tmp_path / "watched", ["--scope-port", "0"], _streamer, args=args)
    assert [r["loss"] for r in watched] == [r["loss"] for r in clean]
    steps = [e for e in got["events"] if e.get("type") == "step" and e["internals"]]
    assert len(steps) >= 3
    for e in steps:
        assert sorted(e["internals"]["residual"]) == ["0", "1"]
