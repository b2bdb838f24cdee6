"""Context parallelism: ring (p2p) and Ulysses (a2a) causal attention on
cp = 2 and 4 Gloo ranks against single-process full causal attention."""

from __future__ import annotations

import math

import pytest

import torch
from dist_harness import run_ranks

B, H, D = 2, 4, 8


def reference(q, k, v):
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(mask, -math.inf), -1) @ v


def _cp_attention(rank, world, comm, seq):
    import megatronapp as mapp
    from megatronapp.models.context_parallel import (
        ring_attention,
        ulysses_attention,
        zigzag_gather,
        zigzag_split,
    )

    state = mapp.initialize_model_parallel(context_parallel_size=world)
    assert state.cp_size == world and state.cp_rank == rank
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, seq, D, generator=g) for _ in range(4))
    mine = [zigzag_split(t, world, rank, 2).clone().requires_grad_() for t in (q, k, v)]
    fn = ring_attention if comm == "p2p" else ulysses_attention
    out = fn(*mine, state.context_group)
    out.backward(zigzag_split(dout, world, rank, 2))
    parts = [out.detach(), *(t.grad for t in mine)]
    gathered = []
    for t in parts:
        got = [torch.empty_like(t) for _ in range(world)]
        torch.distributed.all_gather(got, t.contiguous(), group=state.context_group)
        gathered.append(zigzag_gather(got, 2))
    return gathered


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("seq_per_chunk", [1, 5])  # 1: the minimum length, 2 x cp
def test_causal_attention_matches_single_process(cp, comm, seq_per_chunk):
    seq = 2 * cp * seq_per_chunk
    out, dq, dk, dv = run_ranks(_cp_attention, cp, comm, seq)[0]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, seq, D, generator=g).requires_grad_() for _ in range(4))
    want = reference(q, k, v)
    want.backward(dout.detach())
    torch.testing.assert_close(out, want.detach(), atol=1e-5, rtol=1e-5)
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _bad(rank, world, what):
    import megatronapp as mapp
    from megatronapp.models.context_parallel import ring_attention, ulysses_attention

    state = mapp.initialize_model_parallel(context_parallel_size=world)
    try:
        if what == "heads":
            t = torch.randn(1, 3, 4, D)
            ulysses_attention(t, t, t, state.context_group)
        else:
            t = torch.randn(1, 4, 3, D)  # 3 per rank: 6 tokens, not divisible by 2 x cp
            ring_attention(t, t, t, state.context_group)
    except ValueError as e:
        return str(e)
    return None


def test_bad_shapes_get_clear_errors():
    assert "divisible by --context-parallel-size 2" in run_ranks(_bad, 2, "heads")[0]
    msg = run_ranks(_bad, 2, "seq")[0]
    assert msg and "not divisible by 2 x --context-parallel-size (4)" in msg


# ---- a GPT through pretrain_gpt.py's loop ---------------------------------------------
GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-iters", "1", "--no-progress",
       "--log-interval", "1000", "--no-watchdog"]


def _train(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    res = train(build_parser().parse_args(GPT + flags + ["--output-dir", out_dir]))
    return res["losses"], [h["grad_norm"] for h in res["history"]]


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_tp2_cp2_gpt_matches_tp2_step_for_step(tmp_path, comm):
    steps = ["--train-iters", "10", "--tensor-model-parallel-size", "2"]
    tp2, n_tp2 = run_ranks(_train, 2, steps, str(tmp_path / "a"))[0]
    cp2, n_cp2 = run_ranks(_train, 4, steps + ["--context-parallel-size", "2",
                                               "--cp-comm-type", comm, "--sequence-parallel"],
                           str(tmp_path / "b"))[0]
    for a, b in zip(tp2, cp2, strict=True):
        assert abs(a - b) < 1e-5, (tp2, cp2)
    for a, b in zip(n_tp2, n_cp2, strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, a), (n_tp2, n_cp2)


def test_cp_composes_with_pipeline_zero1_and_resumes_at_cp1(tmp_path):
    ck = str(tmp_path / "ck")
    flags = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
             "--pipeline-schedule", "zero-bubble"]
    full, _ = run_ranks(_train, 4, flags + ["--train-iters", "4", "--context-parallel-size",
                                            "2", "--save", ck, "--save-interval", "2"],
                        str(tmp_path / "a"))[0]
    ref, _ = run_ranks(_train, 2, flags + ["--train-iters", "4"], str(tmp_path / "r"))[0]
    for a, b in zip(full, ref, strict=True):
        assert abs(a - b) < 1e-5, (full, ref)
    resumed, _ = run_ranks(_train, 2, flags + ["--train-iters", "4", "--load",
                                               ck + "/iter_0000002"], str(tmp_path / "b"))[0]
    assert abs(resumed[0] - full[2]) < 1e-5, (resumed, full)


# CP2 next to the same run at CP1 (the cp ranks become absent; dp stays):
# (extra flags, ranks at CP1, loss tolerance). Exact compositions agree to
# fp32 summation order; int8's error feedback and bf16 round partial sums
# that differ between the layouts.
COMPOSED = {
    "pp2-interleaved-full-recompute": (["--num-layers", "4", "--pipeline-model-parallel-size",
                                        "2", "--virtual-pipeline-model-parallel-size", "2",
                                        "--recompute-granularity", "full", "--recompute-method",
                                        "uniform", "--recompute-num-layers", "1"], 2, 1e-5),
    "pp2-dynamic-selective-a2a": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                   "dynamic", "--recompute-granularity", "selective",
                                   "--cp-comm-type", "a2a"], 2, 1e-5),
    "dp2-int8": (["--grad-compression", "int8"], 2, 3e-4),
    "dp2-bf16-zero1": (["--bf16", "--use-distributed-optimizer"], 2, 3e-4),
}


@pytest.mark.parametrize("case", list(COMPOSED))
def test_cp_composes_with_schedules_recompute_codecs_and_bf16(tmp_path, case):
    flags, world, tol = COMPOSED[case]
    steps = ["--train-iters", "6"]
    ref, _ = run_ranks(_train, world, steps + flags, str(tmp_path / "a"))[0]
    cp2, _ = run_ranks(_train, 2 * world, steps + flags + ["--context-parallel-size", "2"],
                       str(tmp_path / "b"))[0]
    assert ref[-1] < ref[0] - 0.1, ref  # it trains
    for a, b in zip(ref, cp2, strict=True):
        assert abs(a - b) < tol * max(1.0, abs(a)), (case, ref, cp2)


def _traced(rank, world, out_dir):
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(GPT + ["--train-iters", "2", "--context-parallel-size", "2",
                                            "--output-dir", out_dir, "--trace", "--trace-dir",
                                            out_dir + "/trace"])
    return train(args)["losses"]


def test_ring_steps_are_trace_events(tmp_path):
    import os

    from megatronapp.trace.aggregate import load_trace

    run_ranks(_traced, 2, str(tmp_path))
    events = load_trace(os.path.join(str(tmp_path), "trace", "trace.rank1.json"))
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    assert {"cp_ring_step", "cp_ring_step_backward", "cp_ring_wait"} <= names, names


@pytest.mark.parametrize("flags,world,message", [
    (["--context-parallel-size", "2", "--seq-length", "30"], 2, "not divisible by 2 x"),
    (["--context-parallel-size", "3"], 4, "not divisible by .* --context-parallel-size 3"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "2",
      "--hidden-size", "64", "--tensor-model-parallel-size", "2"], 4, "heads per tensor rank"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, "attention-dropout"),
])
def test_bad_context_parallel_flags_are_refused_before_any_collective(flags, world, message):
    import re

    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config
    from megatronapp.training.config import ConfigError

    with pytest.raises(ConfigError) as e:
        Config.from_args(build_parser().parse_args(flags)).check(world)
    assert re.search(message, str(e.value)), str(e.value)
