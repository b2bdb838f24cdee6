"""The pipeline executor: runs this rank's actions of a schedule (a front-end:
the executor is the C++ engine's ``mapp::forward_backward``, shared with C++
trainers; this module hands it the model chunks, the data and the loss as
callables, which it calls with the GIL, and releases the GIL around every wait
and every backward pass so the dead-rank watchdog's heartbeat keeps running).

    result = forward_backward(schedule, model_chunks, data_iterator, loss_fn,
                              tensor_shape=(seq, micro_batch, hidden))
    result.losses            # last stage: one loss per microbatch

Semantics (those the validator and simulator assume): actions run in order;
RECV_* posts a non-blocking receive and SEND_* a non-blocking send (several
transfers in flight, matched by tag = (kind, microbatch, virtual stage)); F, B
and BI wait only for their own input. BI computes the input gradient with the
linear layers' weight gradients deferred (:mod:`megatronapp.autograd`) and W computes
them. ``data_iterator`` yields ``(inputs, target)`` per microbatch: the first
virtual stage feeds ``inputs`` to chunk 0 and the last computes
``loss_fn(output, target)``; the loss is divided by the number of
microbatches before backward, so gradients are the mean over microbatches.
An item may be ``(inputs, target, kwargs)``: every chunk's forward of that
microbatch gets ``kwargs`` (a packed microbatch's ``packed=PackedSeq``).

With ``scatter_gather=True`` and tensor parallelism, the tensors between
stages are the same on every tensor rank (no sequence parallelism), so each
tensor rank sends only its 1/tp slice to the same tensor rank of the peer
stage, which all-gathers the slices over the tensor group (Megatron-LM's
scatter/gather optimization, Narayanan et al. 2021): the pipeline link carries
one copy of each activation and gradient instead of tp copies.

With the ``wave`` placement (ZB-V) the turn from one chunk to the next stays
on its stage: the output is handed to the other chunk as if it had arrived
(a copy that requires grad), and the input gradient goes back the same way.

Chunks that implement :class:`GradSync` (megatronapp's
:class:`~megatronapp.distributed.data_parallel.DistributedDataParallel` does) synchronize
only during their final backward (and final W), so a chunk's data-parallel
reduction starts as soon as its last weight gradient is done, while other
chunks still compute; the executor finishes all of them at the end of the
step. The executor knows nothing else about data parallelism.

Transfers go through the pipeline group's shared-memory transport when it is
attached (``enable_shared_memory(group, p2p=True)``) and a message fits one
ring, else through c10d; ``MAPP_INJECT_LINK_DELAY`` delays this rank's
messages to one peer; per-microbatch compute and P2P events go to the tracer
at full granularity. An exception raised by a chunk, the loss or a custom
autograd function propagates as itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .. import _C
from .. import trace as _trace
from ..parallel_state import ParallelState, resolve_state
from .schedules import Schedule

__all__ = ["forward_backward", "GradSync", "PipelineResult"]


@runtime_checkable
class GradSync(Protocol):
    """What the executor needs from a model chunk whose gradients are
    synchronized across data-parallel ranks (e.g. megatronapp's DDP)."""

    def no_sync(self):
        """Context: backward passes inside accumulate without communicating."""

    def deferred_grad_sync(self):
        """Context: a backward pass's end does not finish the reduction."""

    def finish_grad_sync(self) -> None:
        """Completes the step's reduction (waits for it)."""


@dataclass
class PipelineResult:
    losses: list = field(default_factory=list)  #: last stage: per-microbatch loss (detached)
    peak_activations: int = 0  #: most microbatch-chunk activations held at once
    compute_time: dict = field(default_factory=dict)  #: type -> mean seconds per action
    recv_wait_time: float = 0.0  #: seconds spent waiting for inputs
    sent_bytes: int = 0  #: bytes this rank sent to its pipeline peers
    step_time: float = 0.0
    tensor_shape: tuple | None = None  #: of the tensors between stages
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    shared_memory: bool = False  #: transfers went through the shared-memory transport


def to_device(inputs, device):
    """A microbatch's first-stage inputs on `device`: a tensor, or a tuple of
    tensors (a multimodal model's images and tokens)."""
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(to_device(t, device) for t in inputs)
    return inputs.to(device)


class _Batches:
    """The microbatches drawn so far, by index (drawn on first use)."""

    def __init__(self, data_iterator):
        self.it, self.items = data_iterator, []

    def __call__(self, mb: int):
        while len(self.items) <= mb:
            if self.it is None:
                raise ValueError("forward_backward: this stage needs data but data_iterator is None")
            self.items.append(next(self.it))
        return self.items[mb]

    def kwargs(self, mb: int) -> dict:
        """The keyword arguments of the chunks' forward for microbatch `mb`:
        the third element of an (x, y, kwargs) item (a packed microbatch's
        documents), else none (also on a stage without data)."""
        if self.it is None and len(self.items) <= mb:
            return {}
        item = self(mb)
        return item[2] if len(item) > 2 else {}


class _NoSyncSwitch:
    """set_sync(False) enters a chunk's ``no_sync()``, set_sync(True) leaves
    it (for synchronizers other than megatronapp's DDP, whose reducer the
    engine drives directly)."""

    def __init__(self, chunk):
        self.chunk, self.ctx = chunk, None

    def __call__(self, on: bool) -> None:
        if on and self.ctx is not None:
            ctx, self.ctx = self.ctx, None
            ctx.__exit__(None, None, None)
        elif not on and self.ctx is None:
            self.ctx = self.chunk.no_sync()
            self.ctx.__enter__()


def pipeline_groups(state: ParallelState):
    """The engine's view of where this rank sits in the pipeline
    (``_C.pipeline.PipelineGroups``)."""
    return _C.pipeline.PipelineGroups(
        state.pipeline_group.group_name if state.pp_size > 1 else "", state.pp_rank,
        list(state.group_ranks["pp"]),
        state.tensor_group.group_name if state.tp_size > 1 else "", state.tp_rank, state.tp_size)


def _forward(chunk, batch: _Batches, loss_fn, last: bool):
    """The engine's view of one chunk: (input, microbatch) -> output, or the
    loss on the last virtual stage; input None = this microbatch's first-stage
    inputs (a tensor or a tuple of them)."""
    def forward(x, mb):
        out = chunk(batch(mb)[0] if x is None else x, **batch.kwargs(mb))
        return loss_fn(out, batch(mb)[1]) if last else out
    return forward


def forward_backward(schedule: Schedule, model_chunks, data_iterator, loss_fn, *,
                     tensor_shape=None, dtype: torch.dtype = torch.float32,
                     parallel_state: ParallelState | None = None,
                     forward_only: bool = False,
                     scatter_gather: bool = False) -> PipelineResult:
    """Runs one step of `schedule` on this rank (its pipeline stage).

    Args:
        schedule: a :class:`Schedule` with ``stages`` = the pipeline size.
        model_chunks: a module or a list of ``schedule.chunks`` modules (this
            rank's chunks, in order), optionally DDP-wrapped.
        data_iterator: yields ``(inputs, target)`` per microbatch; only used on
            the first and last stage (None elsewhere is fine).
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        tensor_shape, dtype: shape and dtype of the tensors between stages.
        forward_only: run the forwards only (evaluation), without autograd.
        scatter_gather: the tensors between stages are equal on every tensor
            rank (tensor parallelism without sequence parallelism): send 1/tp
            of each and all-gather it over the tensor group on arrival.
    """
    state = resolve_state(parallel_state)
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    p, v = schedule.stages, schedule.chunks
    if p != state.pp_size:
        raise ValueError(f"forward_backward: schedule '{schedule.name}' has {p} stages but the "
                         f"pipeline-parallel size is {state.pp_size}")
    if len(chunks) != v:
        raise ValueError(f"forward_backward: schedule '{schedule.name}' has {v} chunks per stage "
                         f"but {len(chunks)} model chunks were given")
    stage = state.pp_rank
    device = next(iter(chunks[0].parameters())).device
    batch = _Batches(data_iterator)
    last_vs = p * v - 1
    forwards = [_forward(c, batch, loss_fn, schedule.vstage(stage, i) == last_vs)
                for i, c in enumerate(chunks)]

    def first_input(mb):  # drawn before the forward's clock starts
        x = batch(mb)[0]
        return x if isinstance(x, torch.Tensor) else None

    # megatronapp's DDP: the engine drives its reducer; any other GradSync
    # through its no_sync() / finish_grad_sync(), inside deferred_grad_sync().
    reducers = [r if isinstance(r := getattr(c, "_reducer", None), _C.GradReducer) else None
                for c in chunks]
    others = [c if r is None and isinstance(c, GradSync) and not forward_only else None
              for c, r in zip(chunks, reducers, strict=True)]
    groups = pipeline_groups(state)
    with contextlib.ExitStack() as scope:
        for c in others:
            if c is not None:
                scope.enter_context(c.deferred_grad_sync())
        switches = [_NoSyncSwitch(c) if c is not None else None for c in others]
        scope.callback(lambda: [s(True) for s in switches if s is not None])
        r = _C.pipeline.forward_backward(
            schedule.cpp, forwards, reducers, switches,
            [c.finish_grad_sync if c is not None else None for c in others], first_input, groups,
            list(tensor_shape) if tensor_shape is not None else [], dtype, device, forward_only,
            scatter_gather, _trace.full(), _trace.gpu_timing())
    return PipelineResult(tensor_shape=tuple(tensor_shape) if tensor_shape else None,
                          dtype=dtype, device=device, **r)
