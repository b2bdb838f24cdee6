"""Activation recomputation: selective (core attention) and full (uniform /
block) give bit-identical fp32 losses, gradients and updated weights to the
run without recomputation, with dropout on (the RNG tracker replays the
masks), under TP + SP and every pipeline schedule (including zero-bubble's
deferred weight gradients), and with ZeRO-1 and bf16.

The reference is the same model, batches and schedule without
recomputation; equality is exact (torch.equal), not a tolerance."""

import pytest

import torch
from dist_harness import assert_variants_identical, run_ranks, train_variants

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", "2", "--eval-iters", "1",
         "--no-progress", "--no-watchdog", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1"]

MODES = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"],
    "full-block": ["--recompute-granularity", "full", "--recompute-method", "block",
                   "--recompute-num-layers", "1"],
    "full-distributed": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "2", "--distribute-saved-activations"],
}


TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--sequence-parallel", "--attention-backend", "unfused"]


@pytest.mark.parametrize("schedule", [
    ["--pipeline-schedule", "1f1b"],
    ["--pipeline-schedule", "gpipe"],
    ["--pipeline-schedule", "zero-bubble"],
    ["--pipeline-schedule", "1f1b", "--virtual-pipeline-model-parallel-size", "2"],
    ["--pipeline-schedule", "dynamic", "--virtual-pipeline-model-parallel-size", "2"],
], ids=["1f1b", "gpipe", "zero-bubble", "interleaved", "dynamic"])
def test_recompute_is_bit_identical_in_every_schedule(tmp_path, schedule):
    modes = ["none", "selective", "full-uniform", "full-block"]
    results = run_ranks(train_variants, 4, FLAGS + TP2PP2 + schedule,
                        {m: MODES[m] for m in modes}, str(tmp_path), timeout=400)
    assert_variants_identical(results, modes)
    # Dropout is on: the losses differ from a dropout-free run (the masks are
    # real), and the pipeline stages agree on the loss.
    assert len({r["none"][0][0] for r in results}) == 1


@pytest.mark.parametrize("layout", [
    # fused attention with dropout, ZeRO-1, saved layer inputs split over tp
    ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    # bf16 with fp32 main gradients, zero-bubble, SP
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--pipeline-schedule", "zero-bubble", "--sequence-parallel", "--bf16"],
], ids=["tp2-dp2-zero1-distributed", "tp2-pp2-zb-bf16"])
def test_recompute_composes_with_zero1_and_bf16(tmp_path, layout):
    modes = ["none", "selective", "full-uniform"]
    if "--sequence-parallel" not in layout:
        modes.append("full-distributed")
    results = run_ranks(train_variants, 4, FLAGS + layout, {m: MODES[m] for m in modes},
                        str(tmp_path), timeout=400)
    assert_variants_identical(results, modes)


def test_dropout_masks_differ_across_tensor_ranks_only_where_sharded():
    """The tracker: fork draws from the named state and leaves the default
    generator where it was; states are per-name and restorable."""
    from megatronapp.tensor_parallel.random import RNGStatesTracker

    t = RNGStatesTracker("cpu")
    t.add("a", 11)
    with pytest.raises(ValueError, match="seed 11 is already used"):
        t.add("b", 11)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with t.fork("a"):
        x = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # default untouched
    torch.manual_seed(11)
    assert torch.equal(x, torch.rand(4))  # drawn from the state seeded with 11
    saved = t.get_states()
    with t.fork("a"):
        y = torch.rand(4)
    t.set_states(saved)
    with t.fork("a"):
        assert torch.equal(torch.rand(4), y)
    with pytest.raises(RuntimeError, match="no state 'zz'"):
        with t.fork("zz"):
            pass


def test_checkpoint_replays_dropout_single_process():
    """A checkpointed region with dropout: same output, same input and
    parameter gradients as running it plainly from the same RNG state."""
    from megatronapp.tensor_parallel import checkpoint

    lin = torch.nn.Linear(8, 8).double()

    def region(x):
        return torch.nn.functional.dropout(torch.tanh(lin(x)), 0.5, True).sum(-1)

    x0 = torch.randn(3, 8, dtype=torch.float64)
    torch.manual_seed(7)
    x = x0.clone().requires_grad_()
    region(x).sum().backward()
    want = (x.grad.clone(), lin.weight.grad.clone())
    after_plain = torch.rand(1)
    lin.zero_grad()
    torch.manual_seed(7)
    x = x0.clone().requires_grad_()
    y = checkpoint(region, False, x)
    after_ckpt = torch.rand(1)  # the stream continues as without recompute
    y.sum().backward()
    assert torch.equal(x.grad, want[0]) and torch.equal(lin.weight.grad, want[1])
    assert torch.equal(after_plain, after_ckpt)


@pytest.mark.parametrize("flags,message", [
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "block"],
     "needs --recompute-num-layers"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "applies only to --recompute-granularity full"),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method",
      "block", "--recompute-num-layers", "1"], "contradicts"),
    (["--distribute-saved-activations"], "needs --recompute-granularity full"),
    (["--hidden-dropout", "1.0"], "--hidden-dropout must be in"),
])
def test_bad_recompute_flags_are_named(flags, message):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    cfg = Config.from_args(build_parser().parse_args(flags))
    with pytest.raises(ConfigError, match=message):
        cfg.check(1)
