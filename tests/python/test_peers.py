"""The peers' harness cannot rot: a few steps of every configuration of
benchmarks/peers/run.py (PyTorch DDP / FSDP2 / DTensor TP / pipelining 1F1B and
zero-bubble, DeepSpeed ZeRO-1 / ZeRO-2 / PipelineModule, Megatron-Core TP x DP /
1F1B / interleaved, and ours) on 4 Gloo ranks, and the check that they compute
the same function: from the same weights and batches every exact configuration
(no lossy gradient codec) reports the same losses, step by step, to 1e-3.

DeepSpeed and Megatron-Core live in .venv-peers (``make peers``; ``make test``
builds it)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "benchmarks", "peers", "run.py")
sys.path.insert(0, os.path.dirname(RUN))
import run as peers  # noqa: E402


def test_every_stack_trains_the_same_function():
    assert os.path.exists(peers.PEERS_PYTHON), (
        f"{peers.PEERS_PYTHON} is missing: run `make peers` (make test does it)")
    keys = list(peers.CONFIGS)
    proc = subprocess.run([sys.executable, RUN, "--smoke", "--configs", ",".join(keys),
                           "--port", "29871"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode in (0, 1), proc.stdout[-4000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mismatches"] == [], out["mismatches"]
    assert proc.returncode == 0
    losses = out["losses"]
    assert sorted(losses) == sorted(keys)
    first = losses[out["reference"]][0]
    # Byte-level vocabulary (256 padded to 384 for tp 2 at divisible-by 128): a
    # fresh model predicts ~uniformly over the padded vocabulary.
    assert 5.4 < first < 6.0, first
    for k, v in losses.items():
        assert len(v) == 4  # 3 steps and the final validation loss
        assert v[2] < v[0], f"{k} did not learn: {v}"


def test_unknown_configuration_is_named():
    proc = subprocess.run([sys.executable, RUN, "--smoke", "--configs", "torch-ddp,nope"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0 and "unknown --configs ['nope']" in proc.stderr

