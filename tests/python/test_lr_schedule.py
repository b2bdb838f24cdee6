"""--lr-decay-style and --train-samples: every style against its closed form
(Megatron-LM's OptimizerParamScheduler, transcribed here), the rates a run
takes, bit-identical resume in the middle of a WSD anneal under ZeRO-1 in
samples, and the errors for flags that cannot go together."""

import math
import os
import types

import pytest

from dist_harness import error_messages, run_ranks

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-2", "--min-lr", "1e-3", "--eval-iters", "1", "--no-progress",
         "--log-interval", "1000"]


def _optim(**kw):
    from megatronapp.training.config import OptimConfig

    return OptimConfig(**kw)


def _megatron(style, n, warm, decay, peak, low, init=0.0, wsd=0, wsd_style="exponential"):
    """Megatron-LM's get_lr at num_steps n, except that its warm-up takes the
    step being taken (n + 1 of W; Megatron-LM's n = 0 runs at --lr-warmup-init)."""
    if warm > 0 and n < warm:
        return init + (peak - init) * (n + 1) / warm
    if style == "constant":
        return peak
    if n > decay:
        return low
    if style == "inverse-square-root":
        return max(low, peak * max(warm, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = (n - warm) / (decay - warm)
    if style == "linear":
        c = 1.0 - ratio
    elif style == "cosine":
        c = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        start = decay - wsd
        if n <= start:
            c = 1.0
        else:
            q = (n - start) / wsd
            c = {"linear": 1.0 - q, "cosine": 0.5 * (math.cos(math.pi * q) + 1.0),
                 "exponential": 2.0 * math.pow(0.5, q) - 1.0, "minus_sqrt": 1.0 - math.sqrt(q)}[
                wsd_style]
    return low + c * (peak - low)


def test_the_default_schedule_is_the_one_earlier_releases_ran_bit_for_bit():
    from megatronapp.training import lr_at

    o = _optim(lr=3e-3, min_lr=3e-4, lr_warmup_iters=10, train_iters=100)
    for it in range(120):
        if it < 10:
            old = 3e-3 * (it + 1) / 10
        else:
            frac = min(1.0, (it - 10) / 90)
            old = 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * frac))
        assert lr_at(o, it) == old, it


@pytest.mark.parametrize("style,wsd_style", [
    ("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
    ("WSD", "exponential"), ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "minus_sqrt")])
def test_every_style_is_its_closed_form_in_iterations_and_in_samples(style, wsd_style):
    from megatronapp.training import lr_at

    wsd = {"lr_wsd_decay_style": wsd_style} if wsd_style else {}
    it_mode = _optim(lr=1e-2, min_lr=1e-4, lr_warmup_iters=5, train_iters=60,
                     lr_decay_iters=50, lr_decay_style=style,
                     lr_wsd_decay_iters=20 if wsd_style else None, **wsd)
    gbs = 8
    sa_mode = _optim(lr=1e-2, min_lr=1e-4, global_batch_size=gbs, train_samples=60 * gbs,
                     lr_decay_samples=50 * gbs, lr_warmup_samples=5 * gbs, lr_decay_style=style,
                     lr_wsd_decay_samples=20 * gbs if wsd_style else None, **wsd)
    for it in range(60):
        want = _megatron(style, it, 5, 50, 1e-2, 1e-4, wsd=20, wsd_style=wsd_style)
        assert lr_at(it_mode, it) == pytest.approx(want, rel=1e-12, abs=1e-15), it
        want_s = _megatron(style, it * gbs, 5 * gbs, 50 * gbs, 1e-2, 1e-4, wsd=20 * gbs,
                           wsd_style=wsd_style)
        if it * gbs < 5 * gbs:  # warm-up in samples: the iteration's samples count
            want_s = 1e-2 * (it + 1) * gbs / (5 * gbs)
        assert lr_at(sa_mode, it) == pytest.approx(want_s, rel=1e-12, abs=1e-15), it
        assert lr_at(sa_mode, it) == pytest.approx(lr_at(it_mode, it), rel=1e-12, abs=1e-15)
    if style == "WSD":  # stable until the anneal, min_lr at its end
        assert lr_at(it_mode, 30) == 1e-2 and lr_at(it_mode, 50) == pytest.approx(1e-4)


def test_warmup_fraction_and_init():
    from megatronapp.training import lr_at

    o = _optim(lr=1.0, min_lr=0.0, train_iters=100, lr_warmup_fraction=0.1,
               lr_warmup_init=0.5, lr_decay_style="linear")
    assert [lr_at(o, i) for i in (0, 4, 9)] == [0.55, 0.75, 1.0]
    assert lr_at(o, 55) == pytest.approx(0.5)


def _check(flags, world=1):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config

    cfg = Config.from_args(build_parser().parse_args(FLAGS + flags))
    cfg.check(world)
    return cfg


def test_train_samples_sets_the_iterations():
    cfg = _check(["--train-samples", "100", "--lr-warmup-samples", "16"])
    assert cfg.optim.train_iters == 12  # 100 // 8, Megatron-LM's rule


def test_schedule_flags_that_cannot_go_together_are_named():
    from megatronapp.training import ConfigError

    msgs = error_messages(
        lambda: _check(["--train-iters", "10", "--train-samples", "80"]),
        lambda: _check(["--train-samples", "80", "--lr-decay-iters", "5"]),
        lambda: _check(["--lr-decay-samples", "80"]),
        lambda: _check(["--lr-decay-style", "WSD", "--train-iters", "10"]),
        lambda: _check(["--lr-decay-style", "WSD", "--train-iters", "10", "--lr-warmup-iters",
                        "4", "--lr-wsd-decay-iters", "8"]),
        lambda: _check(["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"]),
        lambda: _check(["--train-samples", "4"]),
        lambda: _check(["--lr-wsd-decay-iters", "4"]),
        lambda: _check(["--lr-decay-style", "cubic"]),
        exc=(ConfigError, SystemExit))
    assert "--train-iters and --train-samples both given" in msgs[0]
    assert "--lr-decay-iters: with --train-samples the schedule is counted in samples" in msgs[1]
    assert "--lr-decay-samples count the schedule in samples: give --train-samples" in msgs[2]
    assert "WSD needs --lr-wsd-decay-iters" in msgs[3]
    assert "--lr-wsd-decay-iters 8 is longer than the decay after the warm-up (10 - 4)" in msgs[4]
    assert "--lr-warmup-fraction and --lr-warmup-iters" in msgs[5]
    assert "--train-samples 4 is less than one global batch" in msgs[6]
    assert "anneal of --lr-decay-style WSD, not of cosine" in msgs[7]
    assert msgs[8] == "2"  # argparse: invalid choice (exit status 2, its own message)


WSD_SAMPLES = ["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "minus_sqrt",
               "--train-samples", "64", "--lr-warmup-samples", "8", "--lr-wsd-decay-samples",
               "32", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2"]


def _train(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    try:
        s = train(build_parser().parse_args(FLAGS + flags + ["--output-dir", out_dir]))
    except SystemExit as e:
        return str(e)
    return [(h["lr"], h["loss"]) for h in s["history"]]


def test_a_wsd_run_in_samples_takes_its_rates_and_resumes_bit_identically(tmp_path):
    """TP2 x DP2 with ZeRO-1, 8 iterations counted in samples: the rates are
    lr_at's; resumed from iteration 5 (inside the anneal) the last three
    steps are the full run's, bit for bit; resumed with another schedule,
    that schedule runs (said or, with --override-opt-param-scheduler, not)."""
    from megatronapp.training import lr_at

    ck = str(tmp_path / "ck")
    full = run_ranks(_train, 4, WSD_SAMPLES + ["--save", ck, "--save-interval", "5"],
                     str(tmp_path / "a"))[0]
    o = types.SimpleNamespace(lr=1e-2, min_lr=1e-3, lr_warmup_init=0.0, global_batch_size=8,
                              train_samples=64, lr_decay_samples=None, lr_warmup_samples=8,
                              lr_wsd_decay_samples=32, lr_warmup_fraction=None,
                              lr_decay_style="WSD", lr_wsd_decay_style="minus_sqrt")
    assert [lr for lr, _ in full] == [lr_at(o, i) for i in range(8)]
    # warm-up (1 iteration), stable until sample 32 (iteration 4), then the anneal
    assert full[1][0] == full[4][0] == 1e-2 and full[5][0] < 1e-2
    at5 = os.path.join(ck, "iter_0000005")
    resumed = run_ranks(_train, 4, WSD_SAMPLES + ["--load", at5], str(tmp_path / "b"))[0]
    assert resumed == full[5:]  # exact floats
    other = [f if f != "minus_sqrt" else "linear" for f in WSD_SAMPLES]
    changed = run_ranks(_train, 4, other + ["--load", at5], str(tmp_path / "c"))[0]
    assert len(changed) == 3 and changed[0][0] != full[5][0]  # the command line's schedule
    forced = run_ranks(_train, 4, other + ["--load", at5, "--override-opt_param-scheduler"],
                       str(tmp_path / "d"))[0]
    assert forced == changed


def _warned(rank, world, flags, out_dir):
    """The warnings rank 0 printed (the C++ logger writes to the process's stderr)."""
    import os
    import tempfile

    err = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(err.fileno(), 2)
    try:
        _train(rank, world, flags, out_dir)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    err.seek(0)
    return err.read().decode(errors="replace")


def test_a_changed_schedule_on_resume_is_named(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(_train, 1, ["--train-iters", "2", "--save", ck], str(tmp_path / "a"))
    said = run_ranks(_warned, 1, ["--train-iters", "4", "--lr-decay-style", "linear", "--load",
                                  ck], str(tmp_path / "b"))[0]
    assert "this run's learning-rate schedule differs from the checkpoint's (lr_decay_style " \
        "'cosine' in the checkpoint, 'linear' here; decay 2 in the checkpoint, 4 here)" in said, said
    quiet = run_ranks(_warned, 1, ["--train-iters", "4", "--lr-decay-style", "linear", "--load",
                                   ck, "--override-opt-param-scheduler"], str(tmp_path / "c"))[0]
    assert "schedule differs" not in quiet
