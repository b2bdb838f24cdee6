"""Failure handling on real processes: a SIGKILLed rank makes the survivors
exit non-zero within 60 s naming it; SIGTERM saves a checkpoint and exits
cleanly."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dist_harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--no-progress", "--log-interval", "1", "--eval-iters", "1"]


def _launch(world, extra, env_extra, tmp_path):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   **env_extra)
        err = open(tmp_path / f"rank{r}.err", "w")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *ARGS, *extra,
             "--output-dir", str(tmp_path / "out")], env=env, stdout=err, stderr=err))
    return procs


def _wait_all(procs, limit):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return time.monotonic() - t0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [2, 1], ids=["rank2", "rank1-hosts-the-backup-store"])
def test_killed_rank_makes_survivors_exit_naming_it(tmp_path, victim):
    procs = _launch(4, ["--tensor-model-parallel-size", "2", "--train-iters", "400",
                        "--watchdog-timeout", "10"],
                    {"MAPP_INJECT_KILL": f"rank={victim},iteration=3"}, tmp_path)
    elapsed = _wait_all(procs, 120)
    codes = [p.returncode for p in procs]
    assert codes[victim] == -signal.SIGKILL, codes
    assert elapsed < 60 + 15, elapsed  # startup + 3 iterations + detection
    for r in {0, 1, 2, 3} - {victim}:
        assert codes[r] not in (0, None, -signal.SIGKILL), codes
        text = (tmp_path / f"rank{r}.err").read_text()
        assert f"dead rank detected: rank {victim}" in text, text[-2000:]


@pytest.mark.timeout(240)
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    ck = tmp_path / "ck"
    procs = _launch(2, ["--tensor-model-parallel-size", "2", "--train-iters", "100000",
                        "--save", str(ck)], {}, tmp_path)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # wait until training runs
        if "iteration      3/" in (tmp_path / "rank0.err").read_text():
            break
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    _wait_all(procs, 60)
    assert [p.returncode for p in procs] == [0, 0], (tmp_path / "rank0.err").read_text()[-2000:]
    assert "SIGTERM: stopped after iteration" in (tmp_path / "rank0.err").read_text()
    latest = (ck / "latest").read_text().strip()
    assert latest.startswith("iter_") and (ck / latest / "metadata.json").exists()


@pytest.mark.timeout(240)
def test_mismatched_flags_across_ranks_are_one_clear_error(tmp_path):
    port = free_port()
    procs = []
    for r, hidden in enumerate(["64", "64", "128"]):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        err = open(tmp_path / f"rank{r}.err", "w")
        args = [a if a != "64" else hidden for a in ARGS]
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *args,
             "--train-iters", "2", "--output-dir", str(tmp_path / "out")],
            env=env, stdout=err, stderr=err))
    _wait_all(procs, 120)
    assert all(p.returncode != 0 for p in procs)
    text = (tmp_path / "rank0.err").read_text()
    assert "different flags" in text and "--hidden-size: 64 on ranks [0, 1], 128 on ranks [2]" \
        in text, text[-1500:]


def test_sigterm_during_the_agreement_is_not_lost(monkeypatch):
    """The SIGTERM handler runs between bytecodes, possibly right after the
    ranks' agreement all-reduce returns; a signal landing there must stop the
    next iteration (it used to be overwritten by the all-reduce's result)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatronapp.training.hooks import PreemptionHook

    hook = PreemptionHook()
    calls = []

    def all_reduce(t, op=None):  # the peer saw nothing; our signal lands during the call
        calls.append(float(t[0]))
        if len(calls) == 1:
            hook._on_sigterm(signal.SIGTERM, None)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    run = SimpleNamespace(world=2)
    assert hook.should_stop(run, 0) is False  # the all-reduce had already read 0
    assert hook.should_stop(run, 1) is True and calls == [0.0, 1.0]


@pytest.mark.timeout(240)
def test_killing_the_store_host_names_it_on_every_survivor(tmp_path):
    """Plain per-rank launch (no torchrun agent): rank 0 hosts the rendezvous
    store. SIGKILL it: the survivors see the store vanish, say so, agree
    through the backup store on rank 1 that rank 0 is silent there too, and
    all exit non-zero within 60 s naming rank 0."""
    procs = _launch(4, ["--tensor-model-parallel-size", "2", "--train-iters", "400",
                        "--watchdog-timeout", "10"], {"MAPP_INJECT_KILL": "rank=0,iteration=3"},
                    tmp_path)
    t0 = time.monotonic()
    while procs[0].poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.1)
    killed_at = time.monotonic()
    elapsed = _wait_all(procs, 120) - (killed_at - t0)
    codes = [p.returncode for p in procs]
    assert codes[0] == -signal.SIGKILL, codes
    assert elapsed < 60, elapsed
    for r in (1, 2, 3):
        assert codes[r] not in (0, None, -signal.SIGKILL), codes
        text = (tmp_path / f"rank{r}.err").read_text()
        assert "the rendezvous store (hosted by rank 0) is unreachable" in text, text[-2000:]
        assert "dead rank detected: rank 0 (no heartbeat for" in text, text[-2000:]
        assert "it hosted the rendezvous store" in text, text[-2000:]
