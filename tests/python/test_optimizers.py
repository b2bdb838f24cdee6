"""--optimizer adam|sgd with Megatron-LM's --adam-beta1/2, --adam-eps,
--sgd-momentum: the update each one makes (against torch's optimizers stepped
by hand on the run's own gradients), the same training at TP2 x DP2 with
ZeRO-1 and in bf16, and checkpoints that resume bit for bit and reshard."""

import os

import pytest

import torch
from dist_harness import error_messages, run_ranks

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "4", "--eval-iters", "1",
         "--no-progress", "--log-interval", "1000"]


def _one_update(rank, world, flags):
    """The parameters after one step of the run's optimizer, and after torch's
    optimizer of the same kind stepped by hand from the same gradients."""
    from megatronapp import parallel_state
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step
    from megatronapp.training.hooks import default_hooks

    cfg = Config.from_args(build_parser().parse_args(FLAGS + flags + ["--output-dir", "/tmp/o"]))
    run = build_run(cfg, default_hooks(cfg, 1))
    try:
        params = [p for c in run.chunks for p in c.parameters()]
        before = [p.detach().clone() for p in params]
        train_step(run, 0)
        grads = [p.grad.detach().clone() for p in params]
        copies = [b.clone().requires_grad_(True) for b in before]
        o = cfg.optim
        groups = [{"params": [c for c, p in zip(copies, params, strict=True) if p.dim() >= 2],
                   "weight_decay": o.weight_decay},
                  {"params": [c for c, p in zip(copies, params, strict=True) if p.dim() < 2],
                   "weight_decay": 0.0}]
        lr = o.lr / o.lr_warmup_iters  # iteration 0 of the warm-up
        ref = (torch.optim.SGD(groups, lr=lr, momentum=o.sgd_momentum) if o.optimizer == "sgd"
               else torch.optim.AdamW(groups, lr=lr, betas=(o.adam_beta1, o.adam_beta2),
                                      eps=o.adam_eps))
        for c, g in zip(copies, grads, strict=True):
            c.grad = g
        ref.step()
        return max(float((p.detach() - c.detach()).abs().max())
                   for p, c in zip(params, copies, strict=True)), type(run.optimizer).__name__
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("flags,kind", [
    (["--optimizer", "sgd", "--sgd-momentum", "0.8"], "SGD"),
    (["--adam-beta1", "0.8", "--adam-beta2", "0.99", "--adam-eps", "1e-6"], "AdamW")])
def test_each_optimizer_makes_torchs_update(flags, kind):
    err, name = run_ranks(_one_update, 1, flags)[0]
    assert name == kind and err == 0.0, (name, err)


def _train(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    return train(build_parser().parse_args(FLAGS + flags + ["--output-dir", out_dir]))["losses"]


SGD = ["--optimizer", "sgd", "--lr", "5e-2"]


def test_sgd_trains_the_same_under_tp2_dp2_zero1_and_tracks_in_bf16(tmp_path):
    one = run_ranks(_train, 1, SGD, str(tmp_path / "one"))[0]
    adam = run_ranks(_train, 1, [], str(tmp_path / "adam"))[0]
    assert one[-1] < one[0] and one[1] != adam[1]
    for losses in run_ranks(_train, 4, SGD + ["--tensor-model-parallel-size", "2",
                                              "--use-distributed-optimizer"],
                            str(tmp_path / "zero")):
        assert all(abs(a - b) < 1e-5 for a, b in zip(losses, one, strict=True)), (losses, one)
    bf16 = run_ranks(_train, 2, SGD + ["--bf16", "--use-distributed-optimizer"],
                     str(tmp_path / "bf16"))[0]
    assert all(abs(a - b) / b < 0.02 for a, b in zip(bf16, one, strict=True)), (bf16, one)


def test_sgd_momentum_resumes_bit_identically_and_reshards(tmp_path):
    """ZeRO-1 over DP2 x TP2: the momentum buffers' shards are in the
    checkpoint; the run resumed from iteration 2 repeats iterations 3-4 bit
    for bit, and one rank resumes it (momentum resharded) within 1e-5 (a
    fresh momentum would already change iteration 4's loss)."""
    ck = str(tmp_path / "ck")
    flags = SGD + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
    full = run_ranks(_train, 4, flags + ["--save", ck, "--save-interval", "2"],
                     str(tmp_path / "a"))[0]
    at2 = os.path.join(ck, "iter_0000002")
    again = run_ranks(_train, 4, flags + ["--load", at2], str(tmp_path / "b"))[0]
    assert again == full[2:]
    one = run_ranks(_train, 1, SGD + ["--load", at2], str(tmp_path / "c"))[0]
    assert all(abs(a - b) < 1e-5 for a, b in zip(one, full[2:], strict=True)), (one, full)


def test_bad_optimizer_flags_are_named():
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    def check(extra):
        Config.from_args(build_parser().parse_args(FLAGS + extra)).check(1)

    msgs = error_messages(lambda: check(["--optimizer", "sgd", "--optimizer-impl", "fused"]),
                          lambda: check(["--adam-beta2", "1.0"]), exc=ConfigError)
    assert "--optimizer-impl fused is AdamW's" in msgs[0]
    assert "--adam-beta2 must be in [0, 1), got 1.0" in msgs[1]
