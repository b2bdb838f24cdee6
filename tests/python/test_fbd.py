"""MegaFBD (forward/backward disaggregation): the group program, its
simulator and planner against closed forms, and real Gloo runs of
``--forward-backward-disaggregating`` against 1F1B with full recomputation
(the same global batch: losses within 1e-6 over 10 steps), with TP2, ZeRO-1,
tracing, and checkpoints that resume across FBD and non-FBD layouts."""

import glob
import json
import os

import pytest

from dist_harness import run_ranks

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "24",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", "10",
         "--eval-iters", "1", "--no-progress", "--log-interval", "1000",
         "--pipeline-model-parallel-size", "2"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]


# ---- the program, the simulator, the planner ------------------------------------------
def test_program_routes_every_microbatch_once_and_simulates_to_the_closed_form():
    from megatronapp.pipeline.fbd import FBDLayout, program, simulate

    lay = FBDLayout(dp=3, forward=1, backward=2)
    prog = program(lay, p=2, microbatches=6)
    assert prog.name == "fbd 1:2"
    assert prog.actions("forward", 0, 1) == []  # the last stage is the backward ranks'
    fwd0 = prog.actions("forward", 0, 0)
    assert [a.microbatch for a in fwd0 if a.type == "F"] == list(range(6))
    assert [a.peer for a in fwd0 if a.type == "SEND_INPUT"] == [("backward", j % 2, 1)
                                                                 for j in range(6)]
    for i in range(2):
        for s in range(2):
            assert [a.microbatch for a in prog.actions("backward", i, s)
                    if a.type == "B"] == [i, i + 2, i + 4]
    # One forward rank (1 per microbatch) feeds two backward pipelines
    # (recompute 1 + backward 2 per microbatch and stage). Worked by hand:
    # stage 1's backward ranks finish at 10 and 11; stage 0's last backward
    # (microbatch 5, its recomputation done while waiting) ends at 11 + 2.
    sim = simulate(prog, forward=1.0, recompute=1.0, backward=2.0, weight_sync=0.5)
    assert sim.makespan == pytest.approx(13.0)
    assert sim.step == pytest.approx(13.5)
    assert sim.busy[("forward", 0, 0)] == pytest.approx(6.0)
    assert sim.busy[("backward", 1, 1)] == pytest.approx(9.0)
    # A 4x slower forward rank becomes the bottleneck: the last input reaches
    # stage 1 at 24, then 3 there and stage 0's backward (2).
    slow = simulate(prog, forward=1.0, recompute=1.0, backward=2.0, forward_slowdown=4.0)
    assert slow.makespan == pytest.approx(24 + 3 + 2)


def test_planner_prefers_more_backward_ranks_unless_the_forward_ranks_are_slow():
    from megatronapp.pipeline.fbd import choose_ratio

    even = choose_ratio(ranks=4, p=2, microbatches=12, forward=1.0, backward=2.0)
    assert [r["ratio"] for r in even][0] == "1:3"  # recompute + backward: 3x the forward
    assert {r["ratio"] for r in even} == {"1:3", "2:2", "3:1"}
    slow = choose_ratio(ranks=4, p=2, microbatches=12, forward=1.0, backward=2.0,
                        forward_slowdown=4.0)
    assert slow[0]["ratio"] == "2:2"  # 4x slower forwards need a second forward rank
    assert slow[0]["step"] < [r for r in slow if r["ratio"] == "1:3"][0]["step"]


@pytest.mark.parametrize("call,message", [
    (lambda f: f.parse_ratio("1-2"), "expected FORWARD:BACKWARD"),
    (lambda f: f.parse_ratio("0:2"), "both sides must be >= 1"),
    (lambda f: f.FBDLayout(4, 1, 2), "multiple of 3"),
    (lambda f: f.program(f.FBDLayout(2, 1, 1), 1, 4), "needs pipeline parallelism"),
    (lambda f: f.program(f.FBDLayout(3, 1, 2), 2, 3), "do not split evenly"),
])
def test_bad_layouts_get_clear_errors(call, message):
    from megatronapp.pipeline import fbd

    with pytest.raises(ValueError, match=message):
        call(fbd)


# ---- real runs ------------------------------------------------------------------------
def _train(rank, world, extra, out, stop_at=None):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Hook, train

    class StopAt(Hook):  # a preemption after `stop_at` iterations (then the final save)
        def should_stop(self, run, it):
            return stop_at is not None and it + 1 == stop_at

    args = build_parser().parse_args(FLAGS + extra + ["--output-dir", out])
    s = train(args, hooks=[StopAt()])
    return {"losses": s["losses"], "valid": s["valid_loss"],
            "grad_norms": [h["grad_norm"] for h in s["history"]],
            "schedule": s.get("pipeline_schedule")}


def _reference(tmp_path, extra=(), world=2, iters=None):
    flags = FULL_RECOMPUTE + list(extra)
    if iters is not None:
        flags += ["--train-iters", str(iters)]
    return run_ranks(_train, world, flags, str(tmp_path / "ref"))[0]


def _close(got, want, tol=1e-6, what="loss"):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= tol * max(1.0, abs(w)), f"step {i + 1}: {what} {g} vs {w}"


@pytest.mark.parametrize("world,ratio,extra", [
    (4, "1:1", []),
    (6, "1:2", ["--use-distributed-optimizer"]),  # ZeRO-1 over the two backward ranks
    (6, "2:1", ["--trace"]),
])
def test_fbd_matches_1f1b_with_full_recompute(tmp_path, world, ratio, extra):
    want = _reference(tmp_path)
    flags = ["--forward-backward-disaggregating", "--fbd-ratio", ratio, *extra]
    if "--trace" in extra:
        flags += ["--trace-dir", str(tmp_path / "trace")]
    got = run_ranks(_train, world, flags, str(tmp_path / "fbd"))
    for r in got:  # every rank reports the global batch's loss and grad norm
        _close(r["losses"], want["losses"])
        _close(r["grad_norms"], want["grad_norms"], 1e-5, "grad norm")
        assert abs(r["valid"] - want["valid"]) < 1e-6
    assert got[0]["schedule"] == f"fbd {ratio}"
    if "--trace" in extra:  # forward ranks trace forwards, backward ranks recomputations
        names = {}
        for path in glob.glob(str(tmp_path / "trace" / "trace.rank*.json")):
            if path.endswith(".meta.json"):
                continue
            with open(path) as f:
                events = json.load(f)
            events = events["traceEvents"] if isinstance(events, dict) else events
            rank = int(os.path.basename(path).split("rank")[-1].split(".")[0])
            names[rank] = {e.get("name") for e in events}
        from megatronapp._C import Coord, RankGrid

        grid = RankGrid(6, tp=1, pp=2)
        at = {(pp, dp): grid.rank(Coord(0, 0, dp, pp)) for pp in range(2) for dp in range(3)}
        assert "forward" in names[at[0, 0]] and "recompute" not in names[at[0, 0]]
        for pp in range(2):  # dp coordinate 2: the backward rank of each stage
            assert {"recompute", "backward", "fbd-weights"} <= names[at[pp, 2]]
        assert not {"forward", "recompute"} & names[at[1, 0]]  # last stage: the backward's


def test_fbd_with_tensor_parallelism(tmp_path):
    want = _reference(tmp_path, ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                      world=4, iters=4)
    got = run_ranks(_train, 8, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--train-iters", "4", "--forward-backward-disaggregating"],
                    str(tmp_path / "fbd"), timeout=420)
    _close(got[0]["losses"], want["losses"])


def test_checkpoints_resume_across_fbd_and_plain_layouts(tmp_path):
    want = _reference(tmp_path, iters=6)["losses"]
    fbd = ["--forward-backward-disaggregating", "--fbd-ratio", "1:2"]
    for name, first, second in (("to_plain", (6, fbd), (2, FULL_RECOMPUTE)),
                                ("to_fbd", (2, FULL_RECOMPUTE), (6, fbd))):
        ck = str(tmp_path / name)
        a = run_ranks(_train, first[0], [*first[1], "--train-iters", "6", "--save", ck],
                      str(tmp_path / f"{name}_a"), 3)[0]
        b = run_ranks(_train, second[0], [*second[1], "--train-iters", "6", "--load", ck],
                      str(tmp_path / f"{name}_b"))[0]
        _close(a["losses"], want[:2])  # (the history leaves out the iteration it stopped after)
        _close(b["losses"], want[3:])


def test_bad_fbd_flags_fail_before_training(tmp_path):
    with pytest.raises(AssertionError, match="multiple of 3"):
        run_ranks(_train, 4, ["--forward-backward-disaggregating", "--fbd-ratio", "1:2"],
                  str(tmp_path / "x"))
    with pytest.raises(AssertionError, match="one model chunk per stage"):
        run_ranks(_train, 4, ["--forward-backward-disaggregating",
                              "--virtual-pipeline-model-parallel-size", "2"],
                  str(tmp_path / "y"))


def test_fbd_composes_with_codecs_dropout_and_the_memory_pool(tmp_path):
    """int8 gradients over the two backward replicas, dropout (both roles
    draw a microbatch's masks from the same seed), the memory pool: it
    trains, every rank agrees, and it stays near the exact run."""
    want = _reference(tmp_path, iters=6)["losses"]
    got = run_ranks(_train, 6, ["--forward-backward-disaggregating", "--fbd-ratio", "1:2",
                                "--grad-compression", "int8", "--memory-pool",
                                "--hidden-dropout", "0.1", "--train-iters", "6"],
                    str(tmp_path / "fbd"))
    for r in got:
        assert r["losses"] == got[0]["losses"]
    assert got[0]["losses"][0] == pytest.approx(want[0], abs=0.05)  # same weights, 10% dropout
    assert got[0]["losses"][-1] < got[0]["losses"][0] - 0.3
    _close(got[0]["losses"], want, tol=0.05)
