"""Where a training step goes, measured the same way for every stack: a
sampling profiler (py-spy) on each rank, each sample put into one phase by
the Python frames on its stack.

    python benchmarks/peers/spy_phases.py DIR [--step-ms MS]

DIR holds py-spy's raw output of each rank (``rank<r>.txt``, lines
``frame;frame;... count``, outermost frame first), as ``run.py --profile-iters``
writes it. Only samples inside a training step count (ours:
``training.step.train_step``; the peers' trainers: their ``step``); the
ms per iteration of a phase = its share of those samples x the mean step
time of the profiled run. The phases
(issue 26's list; the first rule that matches a stack wins):

====================  ===========================================================
phase                 a sample is in it when its stack holds
====================  ===========================================================
optimizer             ``torch/optim/`` (the update itself)
p2p                   pipeline sends/receives/waits: Megatron's ``p2p_communication``, torch ``pipelining``'s
                      and DeepSpeed's ``pipe`` P2P
dp-reduction          data-parallel gradient reduction: our DDP
                      (``data_parallel.py``), the peers' ``all_reduce_data_parallel``
                      (Megatron harness), DeepSpeed's ``reduce_gradients`` / ZeRO
                      and torch DDP's reducer
grad-finish           norm and clipping, sequence-parallel and embedding sums
loss-report           the loss made known to every rank after the schedule
data                  the batches (dataset reads, microbatch slicing)
tp-collectives        inside the forward/backward: a tensor-parallel collective
                      (our ``_collectives``, Megatron's ``tensor_parallel``
                      mappings, any c10d collective under the model's forward
                      or backward, e.g. vocab-parallel cross-entropy)
executor              the schedule's own code between actions: the innermost
                      frame is the executor (ours ``pipeline/executor.py``,
                      Megatron's ``pipeline_parallel/schedules.py``) itself.
                      Ours is the C++ engine (``mapp::forward_backward``):
                      without native frames its samples (P2P waits, the
                      autograd backward, the reducer) land here; our
                      tracer splits them (``run.py`` reports both)
compute               the rest of the forward/backward (kernels, autograd)
other                 anything else in the step (zero_grad, lr, set-up)
====================  ===========================================================

With ``--idle`` (run.py passes it) a sample is taken whether the thread runs
or waits, so the phases add up to the step's wall time, up to sampling
error. What py-spy cannot split without native frames: time inside Gloo's
threads and the GIL; it lands on the Python frame that waits for it.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

PHASES = ["compute", "tp-collectives", "p2p", "dp-reduction", "optimizer", "grad-finish",
          "loss-report", "data", "executor", "other"]
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")

# The frames that start a training step, per stack.
_STEP = [("train_step", "megatronapp/training/step.py"), ("step", "megatron_gpt.py"),
         ("step", "deepspeed_gpt.py"), ("step", "torch_native.py")]
# The schedules: where "inside the forward/backward" begins.
_EXECUTOR = ("megatronapp/pipeline/executor.py", "core/pipeline_parallel/schedules.py")
_SCHEDULE = [("", e) for e in _EXECUTOR] + [
    ("", "torch/distributed/pipelining/schedules.py"), ("", "deepspeed/runtime/pipe/engine.py"),
    ("batch_loss", "torch_native.py"), ("forward", "deepspeed/runtime/engine.py"),
    ("backward", "deepspeed/runtime/engine.py")]
_P2P = [("", "core/pipeline_parallel/p2p_communication.py"),
        ("", "deepspeed/runtime/pipe/p2p.py"), ("_recv", "torch/distributed/pipelining/"),
        ("_send", "torch/distributed/pipelining/"), ("wait", "torch/distributed/pipelining/"),
        ("batch_isend_irecv", "")]
_DP = [("", "megatronapp/data_parallel.py"), ("", "megatronapp/comm.py"),
       ("all_reduce_data_parallel", ""), ("reduce_gradients", "deepspeed/"),
       ("", "deepspeed/runtime/zero/"), ("_sync_buffers", ""), ("", "torch/nn/parallel/distributed.py"),
       ("", "torch/distributed/fsdp/")]
_FINISH = [("", "megatronapp/gradients.py"), ("finalize_model_grads", ""), ("clip", "torch_native.py"),
           ("clip_by_global_norm", ""), ("global_grad_sq", ""), ("clip_grad_norm", ""),
           ("clip_fp32_gradients", "")]
_LOSS = [("share_loss", ""), ("_global_batch_loss", "megatronapp/training/step.py"),
         ("run", "megatron_gpt.py")]
_DATA = [("", "megatronapp/data.py"), ("microbatches", ""), ("global_batch", "")]
_TP = [("", t) for t in ("megatronapp/_collectives.py", "core/tensor_parallel/mappings.py",
                         "torch/distributed/distributed_c10d.py", "torch/distributed/tensor/")]


def _frames(stack: str) -> list:
    out = []
    for f in stack.split(";"):
        m = _FRAME.match(f)
        if m:
            out.append((m["func"], m["file"].replace(os.sep, "/")))
    return out


def _name(func: str) -> str:
    return func.rsplit(".", 1)[-1]  # py-spy qualifies methods: "P2PCommunicator._communicate"


def _has(frames, rules, skip=()) -> bool:
    """Whether a frame matches a ``(function, path part)`` rule (empty: any);
    frames of functions named in `skip` never match."""
    return any(_name(func) not in skip and (not fn or _name(func) == fn)
               and (not path or path in file)
               for func, file in frames for fn, path in rules)


# A module wrapped in our DDP runs its forward through data_parallel.py: only
# the wrapper's hooks and reductions are data-parallel work.
_FORWARDS = ("forward", "_call_impl", "_wrapped_call_impl")


def classify(stack: str) -> str | None:
    """The phase of one sample (None: outside any training step)."""
    frames = _frames(stack)
    start = next((i for i, (func, file) in enumerate(frames)
                  if any(_name(func) == f and file.endswith(p) for f, p in _STEP)), None)
    if start is None:
        return None
    frames = frames[start:]
    if _has(frames, [("", "torch/optim/")]):
        return "optimizer"
    if _has(frames, _P2P):
        return "p2p"
    if _has(frames, _DP, skip=_FORWARDS):
        return "dp-reduction"
    if not _has(frames, _SCHEDULE):
        for phase, rules in (("data", _DATA), ("grad-finish", _FINISH),
                             ("loss-report", _LOSS)):
            if _has(frames, rules):
                return phase
        return "other"
    if _has(frames, _DATA):
        return "data"
    if _has(frames, _TP):
        return "tp-collectives"
    func, file = frames[-1]
    if any(file.endswith(e) for e in _EXECUTOR) and _name(func) != "custom_backward":
        return "executor"
    return "compute"


def breakdown(path: str, step_ms: float) -> dict:
    """ms per iteration of each phase of one rank's raw py-spy file: each
    phase's share of the samples inside training steps x `step_ms` (the mean
    step time of the profiled run; the sampler, competing for the same cores,
    does not keep its nominal rate)."""
    counts = dict.fromkeys(PHASES, 0)
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        phase = classify(stack)
        if phase is not None:
            counts[phase] += int(n)
    total = sum(counts.values()) or 1
    row = {p: step_ms * c / total for p, c in counts.items()}
    row["step"], row["samples"] = step_ms, total
    return row


def breakdown_dir(directory: str, step_ms: float) -> dict:
    """rank -> :func:`breakdown` of every ``rank<r>.txt`` in `directory`, plus
    ``"mean"`` over the ranks."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.txt"))):
        rows[os.path.basename(path)[4:-4]] = breakdown(path, step_ms)
    if rows:
        keys = list(next(iter(rows.values())))
        rows["mean"] = {k: sum(r[k] for r in rows.values()) / len(rows) for k in keys}
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--step-ms", type=float, default=100.0,
                   help="mean step time of the profiled run (default 100: percentages)")
    a = p.parse_args(argv)
    rows = breakdown_dir(a.dir, a.step_ms)
    if not rows:
        raise SystemExit(f"no rank*.txt in {a.dir}")
    print("| rank | step | " + " | ".join(PHASES) + " |")
    print("|---" * (len(PHASES) + 2) + "|")
    for r, row in rows.items():
        print(f"| {r} | {row['step']:.0f} | " + " | ".join(f"{row[k]:.0f}" for k in PHASES) + " |")


if __name__ == "__main__":
    main()
