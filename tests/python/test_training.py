"""The training edge: one step path for every layout, checks before any
collective, the generated command line, and the hook protocol."""

import os

import pytest

from dist_harness import run_ranks

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", "3",
         "--eval-iters", "1", "--no-progress", "--log-interval", "1000"]

#: The flags and defaults of pretrain_gpt.py before the redesign (public API).
OLD_DEFAULTS = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None, "pipeline_schedule": "1f1b",
    "pipeline_dynamic_policy": "adaptive", "pipeline_memory_limit": None,
    "pipeline_replan_interval": 20, "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None, "pipeline_layer_layout": None,
    "sequence_parallel": False, "distributed_backend": "auto",
    "use_distributed_optimizer": False, "grad_compression": "none",
    "grad_compression_start_iter": 0, "bucket_size_mb": 25.0, "no_overlap_grad_reduce": False,
    "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "ffn_hidden_size": None,
    "seq_length": 128, "make_vocab_size_divisible_by": 128,
    "untie_embeddings_and_output_weights": False, "micro_batch_size": 4,
    "global_batch_size": 16, "lr": 0.003, "min_lr": 0.0003, "lr_warmup_iters": 10,
    "weight_decay": 0.01, "clip_grad": 1.0, "train_iters": 100, "eval_iters": 4,
    "eval_interval": 0, "log_interval": 10, "seed": 1234, "data_path": None,
    "output_dir": "runs/gpt", "no_progress": False, "save": None, "save_interval": None,
    "async_save": False, "load": None, "watchdog_timeout": 30.0, "no_watchdog": False,
    "trace": False, "trace_dir": "runs/trace", "trace_interval": 1, "trace_iterations": None,
    "trace_granularity": "full", "trace_detect_interval": 0, "memory_pool": False,
    "memory_pool_policy": "ours", "record_alloc_trace": None,
}


def test_every_flag_keeps_its_name_and_default():
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config

    args = build_parser().parse_args([])
    for name, default in OLD_DEFAULTS.items():
        assert getattr(args, name) == default, name
    flat = Config.from_args(args).flat()
    assert {k: flat[k] for k in OLD_DEFAULTS} == OLD_DEFAULTS
    assert flat["tensorboard_dir"] is None  # the one new flag


def _hand_loop_vs_train_step(rank, world, extra, out_dir):
    """Reference: the pre-redesign pp = 1 step (model(x, y) per microbatch,
    DDP no_sync for all but the last, loss averaged by hand) on a run built by
    the same set-up, against train() (train_step through the executor)."""
    import contextlib

    import torch.distributed as dist

    import torch
    from megatronapp import parallel_state as ps
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, finish_gradients, lr_at, train

    args = build_parser().parse_args(FLAGS + extra + ["--output-dir", out_dir])
    got = train(args)["losses"]
    run = build_run(Config.from_args(args))
    model, opt, state = run.chunks[0], run.optimizer, run.state
    want = []
    for it in range(run.config.optim.train_iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(run.config.optim, it)
        opt.zero_grad(set_to_none=True)
        tokens, labels = run.dataset.global_batch("train", it, 8, run.config.optim.seed)
        micro = run.dataset.microbatches(tokens, labels, 2, state.dp_rank, state.dp_size)
        total = torch.zeros(1, dtype=torch.float64)
        for i, (x, y) in enumerate(micro):
            ctx = contextlib.nullcontext() if i == len(micro) - 1 else model.no_sync()
            with ctx:
                loss = model(x, y).mean() / len(micro)
                loss.backward()
            total += loss.detach().double()
        dist.all_reduce(total, group=state.data_group)
        finish_gradients(run.chunks, opt, state, run.config.optim.clip_grad)
        opt.step()
        want.append(float(total) / state.dp_size)
    ps.destroy_model_parallel()
    return got, want


@pytest.mark.parametrize("world,extra", [
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (2, []),  # dp 2
    (2, ["--use-distributed-optimizer", "--grad-compression", "int8"]),
])
def test_pp1_step_through_the_executor_matches_the_old_hand_loop(tmp_path, world, extra):
    for got, want in run_ranks(_hand_loop_vs_train_step, world, extra, str(tmp_path)):
        assert len(got) == len(want) == 3
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert abs(g - w) < 1e-5, f"step {step + 1}: train_step {g} vs hand loop {w}"


def _fails_before_any_collective(rank, world, extra_by_rank):
    """Runs train() with every collective entry point instrumented; returns
    (the SystemExit message, the collectives that ran)."""
    import torch.distributed as dist

    from megatronapp.pretrain import build_parser, train

    called = []
    names = ("new_group", "all_reduce", "broadcast", "all_gather", "barrier",
             "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv", "isend", "irecv")
    reals = {name: getattr(dist, name) for name in names}
    for name, real in reals.items():
        def spy(*a, _real=real, _name=name, **k):
            called.append(_name)
            return _real(*a, **k)
        setattr(dist, name, spy)
    args = build_parser().parse_args(FLAGS + extra_by_rank[rank])
    try:
        train(args)
    except SystemExit as e:
        return str(e), called
    finally:  # the rank process serves later tests (P2POp checks for the real isend)
        for name, real in reals.items():
            setattr(dist, name, real)
    return None, called


@pytest.mark.parametrize("extra_by_rank,message", [
    ([["--lr", "1e-3"], ["--lr", "2e-3"]],
     r"different flags.*--lr: 0.001 on ranks \[0\], 0.002 on ranks \[1\]"),
    ([["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33"]] * 2,
     "--seq-length 33 must be divisible by the tensor-parallel size 2 with --sequence-parallel"),
    ([["--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
       "--hidden-size", "63"]] * 2,
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    ([["--grad-compression", "int9"]] * 2, "--grad-compression int9"),
    ([["--trace-detect-interval", "2"]] * 2, "--trace-detect-interval needs --trace"),
])
def test_bad_flags_fail_on_every_rank_before_any_collective(extra_by_rank, message):
    import re

    results = run_ranks(_fails_before_any_collective, 2, extra_by_rank)
    for rank, (msg, called) in enumerate(results):
        assert msg is not None and re.search(message, msg), f"rank {rank}: {msg}"
        assert called == [], f"rank {rank} ran collectives before failing: {called}"


def _tensorboard(rank, world, out_dir, tb_dir):
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(FLAGS + ["--output-dir", out_dir, "--tensorboard-dir",
                                              tb_dir, "--eval-interval", "2"])
    return train(args)


def test_tensorboard_hook_writes_the_loss_curve(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = run_ranks(_tensorboard, 2, str(tmp_path / "out"), str(tmp_path / "tb"))[0]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm-loss", "learning-rate", "grad-norm", "throughput/tokens-per-s",
            "throughput/tflops-per-rank", "validation/lm-loss"} <= tags
    assert any(t.startswith("memory/") for t in tags)
    losses = [e.value for e in acc.Scalars("lm-loss")]
    assert [e.step for e in acc.Scalars("lm-loss")] == [1, 2, 3]
    assert losses == pytest.approx(summary["losses"], rel=1e-6)
    norms = [e.value for e in acc.Scalars("grad-norm")]
    assert norms == pytest.approx([h["grad_norm"] for h in summary["history"]], rel=1e-6)


def _wandb(rank, world, out_dir, save_dir):
    import os

    from megatronapp.pretrain import build_parser
    from megatronapp.training import train

    os.environ["WANDB_MODE"] = "offline"  # no network, no account (the harness restores it)
    os.environ["WANDB_SILENT"] = "true"
    args = build_parser().parse_args(FLAGS + ["--output-dir", out_dir, "--wandb-project", "mapp",
                                              "--wandb-exp-name", "tp2", "--wandb-save-dir",
                                              save_dir, "--eval-interval", "2",
                                              "--tensor-model-parallel-size", "2"])
    return train(args)


def _wandb_records(path):
    """The protobuf records of a W&B run file: a 7-byte header (":W&B", magic
    0xBEE1, version), then LevelDB's log format — 32 KiB blocks of records,
    each with a 7-byte header (CRC, length, type: full / first / middle /
    last piece). The wandb package no longer ships a reader."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, path
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            yield rec


def _wandb_history(save_dir):
    """The scalars of the offline run W&B wrote under `save_dir`, step by step,
    and its config."""
    import glob
    import json

    (path,) = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    steps, config = {}, {}
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in rec.history.item}
            steps.setdefault(items.get("_step"), {}).update(items)
        elif kind == "run":
            for i in rec.run.config.update:
                config[i.key] = json.loads(i.value_json)
    return steps, config


def test_wandb_logs_the_scalars_offline(tmp_path):
    """--wandb-project with WANDB_MODE=offline (TP2, 2 ranks): only the
    logger rank writes a run; each iteration's loss, learning rate and
    throughput are the summary's; the validation loss and the flags are there."""
    summary = run_ranks(_wandb, 2, str(tmp_path / "out"), str(tmp_path / "wb"))[0]
    steps, config = _wandb_history(str(tmp_path / "wb"))
    for i, h in enumerate(summary["history"], 1):
        assert steps[i]["lm-loss"] == h["loss"] and steps[i]["learning-rate"] == h["lr"]
        assert steps[i]["throughput/tflops-per-rank"] == h["tflops_per_rank"]
    assert "validation/lm-loss" in steps[2]
    assert config["tensor_model_parallel_size"] == 2


def _custom_hook(rank, world, out_dir):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Hook, train

    class Recorder(Hook):
        def __init__(self):
            self.events = []

        def on_start(self, run):
            self.events.append(("start", run.start_iteration))

        def on_iteration_end(self, run, it, record):
            self.events.append(("end", it, round(record["loss"], 6)))

        def on_end(self, run, summary):
            summary["recorded"] = len(self.events)

        def close(self, error=None):
            self.events.append(("close", error is None))

    rec = Recorder()
    args = build_parser().parse_args(FLAGS + ["--output-dir", out_dir])
    summary = train(args, hooks=[rec])
    return rec.events, summary["losses"], summary["recorded"]


def test_a_custom_hook_sees_every_iteration(tmp_path):
    events, losses, recorded = run_ranks(_custom_hook, 1, str(tmp_path))[0]
    assert events[0] == ("start", 0) and events[-1] == ("close", True)
    assert [e[2] for e in events if e[0] == "end"] == [round(v, 6) for v in losses]
    assert recorded == 4


def _manual_gc(rank, world, out_dir):
    import gc

    from megatronapp.pretrain import build_parser
    from megatronapp.training import Hook, train

    full = []  # (iteration, automatic?) of each full collection
    state = {"it": 0}

    def watch(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(state["it"])

    class Recorder(Hook):
        def __init__(self):
            self.enabled = []

        def on_iteration_begin(self, run, it):
            state["it"] = it + 1

        def on_iteration_end(self, run, it, record):
            self.enabled.append(gc.isenabled())

    flags = FLAGS + ["--train-iters", "6", "--eval-interval", "3", "--output-dir", out_dir]
    plain = train(build_parser().parse_args(flags))["losses"]
    gc.unfreeze()  # as in a user's process that froze nothing
    gc.callbacks.append(watch)
    try:
        rec = Recorder()
        manual = train(build_parser().parse_args(flags + ["--manual-gc", "--manual-gc-interval",
                                                          "2"]), hooks=[rec])["losses"]
    finally:
        gc.callbacks.remove(watch)
    after = (gc.isenabled(), gc.get_freeze_count())
    gc.freeze()  # the harness's state again
    # A process that froze objects itself keeps them frozen.
    train(build_parser().parse_args(flags + ["--manual-gc", "--no-manual-gc-eval"]))
    kept = gc.get_freeze_count() > 0  # (objects freed since leave it; an unfreeze empties it)
    return plain, manual, rec.enabled, full, after, kept


def test_manual_gc_collects_at_fixed_points_and_restores_the_collector(tmp_path):
    """--manual-gc: no automatic collection during training; full ones after
    setup, every --manual-gc-interval iterations and around evaluations, at
    the same points on every rank; the losses are the automatic collector's;
    the collector (and the freeze) are as they were at the end."""
    for plain, manual, enabled, full, after, kept in run_ranks(_manual_gc, 2, str(tmp_path)):
        assert manual == plain
        assert enabled == [False] * 6
        # after setup; iterations 2, 4, 6; before and after the evaluation after 3; before
        # the final validation
        assert full == [0, 2, 3, 3, 4, 6, 6], full
        assert after == (True, 0) and kept


def test_manual_gc_flags_are_checked():
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    def check(flags):
        with pytest.raises(ConfigError) as e:
            Config.from_args(build_parser().parse_args(flags)).check(1)
        return str(e.value)

    assert "add --manual-gc" in check(["--manual-gc-interval", "100"])
    assert "add --manual-gc" in check(["--no-manual-gc-eval"])
    assert "must be >= 0" in check(["--manual-gc", "--manual-gc-interval", "-1"])
