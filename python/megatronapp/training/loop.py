"""The training loop: an ordered recipe.

setup -> resume -> for each iteration: step, evaluate, save, preempt -> summary.
Everything else (logging, tracing, watchdog, faults, TensorBoard, ...) is a
hook (:mod:`.hooks`); the step is :func:`.step.train_step`.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from .. import checkpoint, memory
from .. import parallel_state as ps
from .. import trace as tracing
from ..pipeline import current_schedule
from .config import Config
from .hooks import CallbacksHook, default_hooks
from .lr_schedule import schedule_changes, schedule_state
from .setup import Run, build_run, init_distributed, install_memory_pool
from .step import evaluate, train_step
from .throughput import Throughput

__all__ = ["train", "resume", "save"]


def train(args, callbacks=None, hooks=(), task=None) -> dict:
    """Runs the whole job on every rank; returns the summary (rank 0 also
    writes it to --output-dir). `args`: a :class:`Config` or the flat
    namespace of :func:`~megatronapp.training.config.build_parser`.
    `callbacks`: an object with ``begin(it)`` / ``end(it, record)``; `hooks`:
    more :class:`~megatronapp.training.hooks.Hook` objects; `task`: the model
    family (:class:`~megatronapp.training.setup.GPTTask` by default)."""
    config = Config.from_args(args)
    install_memory_pool(config)  # before anything allocates
    init_distributed(config)
    hooks = [*default_hooks(config, dist.get_world_size()),
             *([CallbacksHook(callbacks)] if callbacks is not None else []), *hooks]
    error = None
    try:
        run = build_run(config, hooks, task)
        resume(run)
        _each(hooks, "on_start", run)
        optim, ckpt = config.optim, config.checkpoint
        tokens_per_iter = optim.global_batch_size * run.model_config.seq_length
        rate = Throughput(run.model_config, optim.global_batch_size, run.world, run.device,
                          config.logging.peak_tflops)
        history, stopped_at, saved_at, train_seconds = [], None, None, 0.0
        start = time.perf_counter()
        for it in range(run.start_iteration, optim.train_iters):
            _each(hooks, "on_phase", run, f"iteration {it + 1}")
            _each(hooks, "on_iteration_begin", run, it)
            t0 = time.perf_counter()
            with tracing.scope("iteration", "iteration", lane=0):
                step = train_step(run, it)
            dt = time.perf_counter() - t0
            train_seconds += dt
            record = {"iteration": it + 1, "loss": step.loss, "lr": step.lr,
                      "grad_norm": step.grad_norm, "seconds": dt,
                      "tokens_per_s": tokens_per_iter / dt, **rate.of(dt),
                      "train_seconds": train_seconds}
            if step.mtp_losses is not None:
                record["mtp_losses"] = step.mtp_losses
            _each(hooks, "on_iteration_end", run, it, record)
            if optim.eval_interval and (it + 1) % optim.eval_interval == 0 \
                    and it + 1 < optim.train_iters:
                _each(hooks, "on_phase", run, f"evaluation after iteration {it + 1}")
                record["valid_loss"] = _mean(evaluate(run))
                _each(hooks, "on_evaluate", run, it + 1, record["valid_loss"])
            if ckpt.save and ckpt.save_interval and (it + 1) % ckpt.save_interval == 0:
                saved_at = save(run, it + 1, hooks)
            if any([h.should_stop(run, it) for h in hooks]):  # every hook: may be collective
                stopped_at = it + 1
                break
            history.append(record)
        wall = time.perf_counter() - start
        # --overlap-param-gather: the last step's gathers end before anyone reads the weights.
        getattr(run.optimizer, "finish_param_sync", lambda: None)()
        last = stopped_at or optim.train_iters
        if ckpt.save and saved_at != last:
            save(run, last, hooks)
        checkpoint.wait_pending()  # an asynchronous save must be durable before we go on
        _each(hooks, "on_train_end", run)
        _each(hooks, "on_phase", run, "validation")
        valid = evaluate(run)
        if history and optim.eval_interval:
            history[-1]["valid_loss"] = _mean(valid)
        summary = _summary(run, history, valid, wall, train_seconds, tokens_per_iter, stopped_at)
        summary.update(rate.of(train_seconds, len(history)) if history else {})
        _each(hooks, "on_end", run, summary)
        return summary
    except BaseException as e:
        error = e
        raise
    finally:
        for h in reversed(hooks):
            h.close(error)
        ps.destroy_model_parallel()


def resume(run: Run) -> None:
    """--load DIR: restores the latest checkpoint (any layout) into the run."""
    path = run.config.checkpoint.load
    if not path:
        return
    try:
        info = checkpoint.load(path, run.chunks, run.optimizer,
                               config=run.checkpoint_model_config(), parallel_state=run.state)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"--load {path}: {e}") from None
    if info is None:
        if run.is_logger:
            print(f"[megatronapp] no checkpoint in {path}; starting from scratch", flush=True)
        return
    changes = schedule_changes(info["extra"].get("lr_schedule"), run.config.optim)
    if changes and run.is_logger and not run.config.checkpoint.override_opt_param_scheduler:
        # Said, not refused (Megatron-LM refuses): extending a run with a longer
        # --train-iters, whose decay follows it, is the common case.
        from .. import _C

        _C.log("warning", f"--load {info['path']}: this run's learning-rate schedule differs "
                          f"from the checkpoint's ({'; '.join(changes)}); it runs from iteration "
                          f"{info['iteration']} on (--override-opt-param-scheduler: silently)")
    run.start_iteration = info["iteration"]
    # The data continues with the next sample (Megatron's consumed_train_samples);
    # a checkpoint without the count consumed iteration x global batch.
    gbs = run.config.optim.global_batch_size
    consumed = int(info["extra"].get("consumed_samples", run.start_iteration * gbs))
    run.sample_offset = consumed - run.start_iteration * gbs
    run.extra.update(resumed_from=info["path"], same_layout=info["same_layout"])
    scaler = getattr(run.optimizer, "grad_scaler", None)
    if scaler is not None and "grad_scaler" in info["extra"]:  # fp16: the loss scale goes on
        scaler.load_state_dict(info["extra"]["grad_scaler"])


def save(run: Run, iteration: int, hooks=()) -> int:
    """Saves a checkpoint after `iteration` finished steps (collective)."""
    _each(hooks, "on_phase", run, f"saving checkpoint at iteration {iteration}")
    optim = run.config.optim
    scaler = getattr(run.optimizer, "grad_scaler", None)
    checkpoint.save(run.config.checkpoint.save, iteration, run.chunks, run.optimizer,
                    config=run.checkpoint_model_config(),
                    extra={"consumed_samples": run.sample_offset
                           + iteration * optim.global_batch_size,
                           "seed": optim.seed, "lr_schedule": schedule_state(optim),
                           **({"grad_scaler": scaler.state_dict()} if scaler else {})},
                    parallel_state=run.state, async_save=run.config.checkpoint.async_save)
    return iteration


def _each(hooks, method: str, *args) -> None:
    for h in hooks:
        getattr(h, method)(*args)


def _mean(values) -> float | None:
    return sum(values) / len(values) if values else None


def _summary(run, history, valid, wall, train_seconds, tokens_per_iter, stopped_at) -> dict:
    st, plan = run.state, run.plan
    summary = {
        "world_size": run.world, "tp": st.tp_size, "dp": st.dp_size, "pp": st.pp_size,
        "vpp": plan.vpp, "layer_layout": plan.layer_layout,
        "parameters": run.model_config.num_parameters(),
        "iterations": run.config.optim.train_iters,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "valid_loss": _mean(valid),
        "wall_seconds": wall,
        "train_seconds": train_seconds,  # wall minus evaluation and checkpoint saves
        "tokens_per_s": tokens_per_iter * len(history) / train_seconds if train_seconds else 0.0,
        "losses": [h["loss"] for h in history],
        **({"mtp_losses": [h["mtp_losses"] for h in history]}
           if history and "mtp_losses" in history[0] else {}),
        "history": history,
        "comm": {k: sum(c.comm_stats()["step"][k] for c in run.chunks
                        if hasattr(c, "comm_stats"))
                 for k in ("raw_bytes", "sent_bytes")},
    }
    summary.update(run.extra.get("summary", {}))  # what hooks and tasks add (e.g. accuracy)
    if run.config.memory.memory_pool:
        summary["memory"] = memory.stats(run.config.device_type())
    if st.pp_size > 1:
        summary["pipeline_schedule"] = current_schedule(run.schedule).name
    if stopped_at is not None:
        summary["preempted_at"] = stopped_at
    return summary
