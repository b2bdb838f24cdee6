"""Everything around the step that is not the step: hooks.

The loop calls every hook at fixed points, in list order (see :class:`Hook`
for the protocol; every method is optional). A new logger, profiler or fault
injector is one more class here, never a branch in the loop.

    class PrintLoss(Hook):
        def on_iteration_end(self, run, it, record):
            print(it, record["loss"])

    train(args, hooks=[PrintLoss()])

:func:`default_hooks` builds the ones the flags ask for: fault injection,
manual garbage collection, tracing (+ online slow-rank detection), watchdog, preemption on SIGTERM,
allocation-trace recording, progress and summary output, TensorBoard.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import signal

import torch.distributed as dist

import torch

from .. import memory
from .. import trace as tracing
from ..resilience import faults, watchdog

__all__ = ["Hook", "default_hooks", "FaultInjectionHook", "TracingHook", "WatchdogHook", "ScopeHook",
           "PreemptionHook", "AllocationTraceHook", "ProgressHook", "OutputHook",
           "TensorBoardHook", "CallbacksHook", "GarbageCollectionHook"]


class Hook:
    """The protocol. ``run`` is the :class:`~megatronapp.training.setup.Run`;
    ``record`` the iteration's dict (iteration, loss, lr, grad_norm, seconds,
    tokens_per_s, train_seconds; valid_loss after an evaluation) that becomes a
    row of loss.csv; ``summary`` the dict :func:`train` returns."""

    def on_setup(self, config, state, rank: int, world: int, device) -> None:
        """The grid exists, no model yet (every rank)."""

    def on_model(self, modules: list, rank: int) -> None:
        """The model chunks exist, not yet wrapped in DDP."""

    def on_start(self, run) -> None:
        """Built and resumed (``run.start_iteration``); training starts."""

    def on_iteration_begin(self, run, it: int) -> None:
        """Before the step of iteration `it` (0-based)."""

    def on_iteration_end(self, run, it: int, record: dict) -> None:
        """After the step (the time in `record` excludes evaluation and saves)."""

    def on_phase(self, run, text: str) -> None:
        """The loop moves to another phase ("iteration 5", "saving checkpoint
        at iteration 10", "validation", ...)."""

    def on_evaluate(self, run, it: int, valid_loss: float) -> None:
        """After an evaluation at iteration `it` (the number of finished steps)."""

    def should_stop(self, run, it: int) -> bool:
        """Asked on every rank after each iteration; a collective is allowed."""
        return False

    def on_train_end(self, run) -> None:
        """The training iterations and the last save are done (every rank)."""

    def on_end(self, run, summary: dict) -> None:
        """The final evaluation is done too; may add to `summary`."""

    def close(self, error: BaseException | None = None) -> None:
        """Always called, in reverse order; `error` is what ended the run, if
        anything did."""


class FaultInjectionHook(Hook):
    """MAPP_INJECT_SLOWDOWN on the transformer layers, MAPP_INJECT_KILL per iteration."""

    def on_model(self, modules, rank):
        faults.apply_slowdown([layer for m in modules for layer in m.layers], rank)

    def on_iteration_begin(self, run, it):
        faults.maybe_kill(run.rank, it)


class TracingHook(Hook):
    """--trace: a Chrome trace per rank; --trace-detect-interval: online detection."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.detector = None
        self.traced = False
        self.summary = None

    def on_setup(self, config, state, rank, world, device):
        c = state.grid.coord(rank)
        tracing.start(self.cfg.trace_dir, rank, interval=self.cfg.trace_interval,
                      iterations=self.cfg.trace_iterations,
                      granularity=self.cfg.trace_granularity,
                      metadata={"tp": c.tp, "pp": c.pp, "dp": c.dp, "tp_size": state.tp_size,
                                "pp_size": state.pp_size, "dp_size": state.dp_size,
                                "world": world}, device=device.type)
        if self.cfg.trace_detect_interval > 0:
            from ..trace.online import OnlineDetector

            self.detector = OnlineDetector(self.cfg.trace_dir, self.cfg.trace_detect_interval,
                                           world)

    def on_iteration_begin(self, run, it):
        self.traced = tracing.begin_iteration(it)

    def on_iteration_end(self, run, it, record):
        if self.detector is not None and self.traced:
            self.detector.after_traced_iteration(it)

    def on_train_end(self, run):  # the final evaluation is not traced
        stats = tracing.stats()
        tracing.stop()
        self.summary = {"path": stats.get("path"), "events": stats.get("recorded"),
                        "dropped": stats.get("dropped")}

    def on_end(self, run, summary):
        summary["trace"] = self.summary
        if self.detector is not None:
            summary["trace"]["detections"] = self.detector.reports

    def close(self, error=None):
        if tracing.active():
            tracing.stop()


class WatchdogHook(Hook):
    """Dead-rank detection through the store (multi-rank runs)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.dog = None

    def on_start(self, run):
        self.dog = watchdog.Watchdog(timeout=self.timeout).start()

    def on_phase(self, run, text):
        watchdog.set_phase(text)

    def close(self, error=None):
        if self.dog is not None:
            if isinstance(error, Exception):  # a dead peer? give the heartbeat time to name it
                self.dog.explain_failure()  # (exits the process if a rank is dead)
            self.dog.stop(wait_for_peers=error is None)
            self.dog = None


class ScopeHook(Hook):
    """--scope-port: MegaScope serves the run from rank 0
    (:class:`megatronapp.scope.training.TrainingScope`)."""

    def __init__(self, port: int, host: str = "127.0.0.1", token: str | None = None,
                 output_dir: str | None = None):
        from ..scope.training import TrainingScope

        self.scope = TrainingScope(port, host, token, output_dir)

    def on_start(self, run):
        self.scope.on_start(run)

    def on_iteration_begin(self, run, it):
        self.scope.on_iteration_begin(run, it)

    def on_iteration_end(self, run, it, record):
        self.scope.on_iteration_end(run, it, record)

    def close(self, error=None):
        self.scope.close(error)


class PreemptionHook(Hook):
    """SIGTERM on any rank stops every rank after the current iteration (the
    loop then saves a checkpoint with --save)."""

    def __init__(self):
        self.received = False  #: set by the handler only, never cleared
        self.previous = None

    def _on_sigterm(self, signum, frame):
        self.received = True

    def on_start(self, run):
        try:
            self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: no preemption handling
            self.previous = None

    def should_stop(self, run, it):
        # The handler runs between bytecodes, possibly right after the all-reduce
        # returns: it only ever sets `received`, so a signal that lands while
        # the ranks agree is seen at the next iteration instead of being lost.
        if run.world == 1:
            return self.received
        flag = torch.tensor([1.0 if self.received else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # did any rank get SIGTERM?
        return bool(flag.item())

    def close(self, error=None):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


class AllocationTraceHook(Hook):
    """--record-alloc-trace FILE: the CPU pool's allocations, for replay."""

    def __init__(self, path: str):
        self.path = path

    def on_setup(self, config, state, rank, world, device):
        memory.start_recording()

    def on_end(self, run, summary):
        path = self.path
        if "{rank}" in path:
            path = path.replace("{rank}", str(run.rank))
        elif run.world > 1:
            path = f"{path}.rank{run.rank}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        n = memory.stop_recording(path)
        if run.is_logger:
            print(f"[megatronapp] allocation trace: {n} events -> {path}", flush=True)


class ProgressHook(Hook):
    """Rank 0: a progress bar (or log lines with --no-progress) and the summary lines."""

    def __init__(self, logging_cfg):
        self.cfg = logging_cfg
        self.bar = None

    def on_start(self, run):
        if not run.is_logger:
            return
        cfg = run.config
        mc = run.model_config
        active = (f" ({mc.num_parameters(active=True) / 1e6:.2f}M active)"
                  if getattr(mc, "num_experts", None) is not None else "")
        vocab = getattr(mc, "vocab_size", None)
        print(f"[megatronapp] {run.state.describe()}; model "
              f"{mc.num_parameters() / 1e6:.2f}M parameters{active}"
              + (f", vocab {vocab}" if vocab else "") + ", "
              f"{cfg.optim.global_batch_size * mc.seq_length} tokens per iteration",
              flush=True)
        if run.start_iteration:
            print(f"[megatronapp] resumed from {run.extra['resumed_from']} at iteration "
                  f"{run.start_iteration}"
                  + ("" if run.extra.get("same_layout", True) else " (resharded)"), flush=True)
        if not self.cfg.no_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.optim.train_iters, initial=run.start_iteration,
                            desc="train", unit="it", dynamic_ncols=True)

    def on_iteration_end(self, run, it, record):
        if not run.is_logger:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}",
                                 tok_s=f"{record['tokens_per_s']:,.0f}", **_rates(record))
            self.bar.update(1)
        elif (it + 1) % self.cfg.log_interval == 0 or it == run.start_iteration:
            mtp = "".join(f" | mtp_{k + 1} loss {x:.4f}"
                          for k, x in enumerate(record.get("mtp_losses") or ()))
            print(f"iteration {it + 1:6d}/{run.config.optim.train_iters} | loss "
                  f"{record['loss']:.4f}{mtp} | lr {record['lr']:.2e} | grad norm "
                  f"{record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tokens/s"
                  f"{_rate_text(record)}", flush=True)

    def on_end(self, run, summary):
        self.close()
        if not run.is_logger:
            return
        if summary.get("preempted_at") is not None:
            save = run.config.checkpoint.save
            print(f"[megatronapp] SIGTERM: stopped after iteration {summary['preempted_at']}"
                  + (f", checkpoint in {save}" if save else ""), flush=True)
        out = self.cfg.output_dir
        v = summary["valid_loss"]  # None with --eval-iters 0
        valid = f" (validation {v:.3f})" if v is not None else ""
        if summary["history"]:
            print(f"[megatronapp] done: {len(summary['history'])} iterations in "
                  f"{summary['wall_seconds']:.1f}s, loss {summary['first_loss']:.3f} -> "
                  f"{summary['final_loss']:.3f}{valid}, "
                  f"{summary['tokens_per_s']:,.0f} tokens/s{_rate_text(summary, ',')}; loss "
                  f"curve in {out}/loss.csv and "
                  f"loss.png", flush=True)
        else:
            print(f"[megatronapp] nothing to train: already at iteration "
                  f"{run.config.optim.train_iters}{valid}", flush=True)
        comm = summary["comm"]
        if run.state.dp_size > 1 and comm["raw_bytes"]:
            print(f"[megatronapp] data-parallel traffic per step: "
                  f"{comm['sent_bytes'] / 1e6:.2f} MB sent "
                  f"({run.config.data_parallel.grad_compression}; "
                  f"{100 * comm['sent_bytes'] / comm['raw_bytes']:.0f}% of uncompressed)",
                  flush=True)
        if run.config.memory.memory_pool:
            print(memory.summary(run.config.device_type()), end="", flush=True)

    def close(self, error=None):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class OutputHook(Hook):
    """Rank 0: loss.csv, summary.json and loss.png (train and validation loss)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_end(self, run, summary):
        if run.is_logger:
            write_outputs(self.out_dir, summary["history"], summary)


def write_outputs(out_dir: str, history: list, summary: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "loss.csv"), "w", newline="") as f:
        fields = list(dict.fromkeys(k for h in history for k in h)) or ["iteration"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(history)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({k: v for k, v in summary.items() if k not in ("losses", "history")}, f,
                  indent=2)
    # The object API with fixed margins, no pyplot state and no tight_layout:
    # a third of the time (it runs at the end of every run, tests included).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.13, top=0.92)
    ax.plot([h["iteration"] for h in history], [h["loss"] for h in history], label="train")
    evals = [h for h in history if h.get("valid_loss") is not None]
    if len(evals) > 1:
        ax.plot([h["iteration"] for h in evals], [h["valid_loss"] for h in evals], "o-",
                label="validation")
    elif summary.get("valid_loss") is not None:
        ax.axhline(summary["valid_loss"], color="tab:orange", ls="--", label="validation (end)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"GPT {summary['parameters'] / 1e6:.2f}M, tp={summary['tp']} "
                 f"pp={summary['pp']} dp={summary['dp']}")
    ax.legend(loc="upper right")  # a falling curve leaves that corner free
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=100)


class TensorBoardHook(Hook):
    """--tensorboard-dir DIR (rank 0): scalars per iteration — loss, lr, grad
    norm, tokens/s, TFLOP/s per rank and MFU (training/throughput.py), memory
    (the pool's allocated bytes when it is on, else the
    process's peak RSS) — and the validation loss."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.writer = None

    def on_start(self, run):
        if run.is_logger:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.log_dir)

    def on_iteration_end(self, run, it, record):
        if self.writer is None:
            return
        for tag, value in iteration_scalars(run, record).items():
            self.writer.add_scalar(tag, value, it + 1)

    def on_evaluate(self, run, it, valid_loss):
        if self.writer is not None:
            self.writer.add_scalar("validation/lm-loss", valid_loss, it)

    def close(self, error=None):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


#: record key -> the loggers' tag (TensorBoard, W&B)
SCALARS = (("loss", "lm-loss"), ("lr", "learning-rate"), ("grad_norm", "grad-norm"),
           ("tokens_per_s", "throughput/tokens-per-s"), ("seconds", "iteration-time"),
           ("tflops_per_rank", "throughput/tflops-per-rank"), ("mfu", "throughput/mfu"))


def iteration_scalars(run, record) -> dict:
    """{tag: value} of one iteration for the loggers: the record's scalars,
    each MTP depth's loss and the memory in use."""
    out = {tag: record[key] for key, tag in SCALARS if key in record}
    for k, x in enumerate(record.get("mtp_losses") or ()):
        out[f"mtp_{k + 1}-loss"] = x
    out.update(_memory_scalars(run))
    return out


class WandbHook(Hook):
    """--wandb-project P (the logger rank): the same scalars as TensorBoard,
    the validation loss, and the run's flags as the W&B config. ``wandb`` is
    an optional dependency (``pip install megatronapp[wandb]``); with
    ``WANDB_MODE=offline`` it writes under --wandb-save-dir and needs no
    network or account (``wandb sync`` uploads later)."""

    def __init__(self, logging):
        self.cfg = logging
        self.run = None

    def on_start(self, run):
        if not run.is_logger:
            return
        try:
            import wandb
        except ImportError:
            raise SystemExit("--wandb-project needs the wandb package: pip install wandb "
                             "(or megatronapp[wandb])") from None
        save_dir = self.cfg.wandb_save_dir or os.path.join(self.cfg.output_dir, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=self.cfg.wandb_project, name=self.cfg.wandb_exp_name,
                              entity=self.cfg.wandb_entity, dir=save_dir,
                              config=run.config.flat(), reinit="finish_previous")

    def on_iteration_end(self, run, it, record):
        if self.run is not None:
            self.run.log(iteration_scalars(run, record), step=it + 1)

    def on_evaluate(self, run, it, valid_loss):
        if self.run is not None:
            self.run.log({"validation/lm-loss": valid_loss}, step=it)

    def on_end(self, run, summary):
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items()
                                     if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def close(self, error=None):
        if self.run is not None:
            self.run.finish(exit_code=1 if error is not None else 0)
            self.run = None


def _rates(record) -> dict:
    """{short name: formatted value} of the throughput the record knows
    (TFLOP/s per rank, MFU): the progress bar's fields and the log's text."""
    out = {}
    if "tflops_per_rank" in record:
        out["tflops"] = f"{record['tflops_per_rank']:.3g}"
    if "mfu" in record:
        out["mfu"] = f"{100 * record['mfu']:.1f}%"
    return out


def _rate_text(record, sep: str = " |") -> str:
    """' | 12.3 TFLOP/s/rank | MFU 41.2%' of what the record knows."""
    r = _rates(record)
    return ((f"{sep} {r['tflops']} TFLOP/s/rank" if "tflops" in r else "")
            + (f"{sep} MFU {r['mfu']}" if "mfu" in r else ""))


def _memory_scalars(run) -> dict:
    if run.device.type == "cuda":
        return {"memory/allocated-bytes": torch.cuda.memory_allocated(),
                "memory/max-allocated-bytes": torch.cuda.max_memory_allocated()}
    if run.config.memory.memory_pool:
        st = memory.stats("cpu")
        return {"memory/allocated-bytes": st.get("allocated_bytes", 0),
                "memory/reserved-bytes": st.get("reserved_bytes", 0)}
    import resource

    return {"memory/max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class CallbacksHook(Hook):
    """Adapter for ``train(args, callbacks=obj)``: ``obj.begin(it)`` and
    ``obj.end(it, record)`` around each training iteration."""

    def __init__(self, callbacks):
        self.callbacks = callbacks

    def on_iteration_begin(self, run, it):
        self.callbacks.begin(it)

    def on_iteration_end(self, run, it, record):
        self.callbacks.end(it, record)


class GarbageCollectionHook(Hook):
    """--manual-gc (Megatron-LM's flags): Python's automatic collector off for
    the run, full collections at points every rank reaches together — after
    setup, every `interval` iterations, before and after each evaluation —
    so no rank stalls alone while its peers wait in a collective. What lives
    after setup (modules, parameters, optimizer state, imported libraries) is
    frozen out of the collector's sight, so a collection scans only what
    training made since; unless the process froze objects itself (gc.freeze
    is process-wide: then it is left alone). Each collection is a "gc" span
    in the trace. At the end the collector is as it was."""

    EVALUATION_PHASES = ("evaluation", "validation")  # on_phase texts the loop sends

    def __init__(self, interval: int = 0, around_evaluation: bool = True):
        self.interval, self.around_evaluation = interval, around_evaluation
        self.collections = 0
        self._restore = None

    def _collect(self):
        with tracing.scope("gc", "runtime", lane=0):
            gc.collect()
        self.collections += 1

    def on_start(self, run):
        enabled, froze = gc.isenabled(), gc.get_freeze_count() == 0
        self._restore = (enabled, froze)
        gc.disable()
        self._collect()
        if froze:
            gc.freeze()

    def on_iteration_end(self, run, it, record):
        if self.interval and (it + 1) % self.interval == 0:
            self._collect()

    def on_phase(self, run, text):
        if self.around_evaluation and text.startswith(self.EVALUATION_PHASES):
            self._collect()

    def on_evaluate(self, run, it, valid_loss):
        if self.around_evaluation:
            self._collect()

    def close(self, error=None):
        if self._restore is None:
            return
        enabled, froze = self._restore
        self._restore = None
        if froze:
            gc.unfreeze()
        if enabled:
            gc.enable()


def default_hooks(config, world: int) -> list:
    """The hooks the flags ask for, in call order."""
    hooks = [FaultInjectionHook()]
    if config.optim.manual_gc:
        hooks.append(GarbageCollectionHook(config.optim.manual_gc_interval,
                                           not config.optim.no_manual_gc_eval))
    if config.trace.trace:
        hooks.append(TracingHook(config.trace))
    if world > 1 and not config.checkpoint.no_watchdog:
        hooks.append(WatchdogHook(config.checkpoint.watchdog_timeout))
    hooks.append(PreemptionHook())
    if config.memory.record_alloc_trace:
        hooks.append(AllocationTraceHook(config.memory.record_alloc_trace))
    hooks += [ProgressHook(config.logging), OutputHook(config.logging.output_dir)]
    if config.logging.tensorboard_dir:
        hooks.append(TensorBoardHook(config.logging.tensorboard_dir))
    if config.logging.wandb_project:
        hooks.append(WandbHook(config.logging))
    if config.logging.scope_port is not None:
        log = config.logging
        hooks.append(ScopeHook(log.scope_port, log.scope_host, log.scope_token, log.output_dir))
    return hooks
