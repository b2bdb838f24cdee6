"""The pipeline executor: runs this rank's actions of a schedule.

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
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch.distributed as dist

import torch

from .. import _collectives, autograd
from .. import trace as _trace
from ..parallel_state import ParallelState, resolve_state, shared_memory_enabled
from ..resilience import faults
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

_COMPUTE = ("F", "B", "BI", "W")
#: Trace event names of the compute actions (what slow-rank causes read).
_TRACE_NAMES = {"F": "forward", "B": "backward", "BI": "backward-input", "W": "backward-weight"}


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


class _P2P:
    """Non-blocking sends and receives to pipeline peers, matched by tag."""

    def __init__(self, state: ParallelState, schedule: Schedule, shape, dtype, device,
                 scatter_gather: bool = False):
        self.stage = state.pp_rank
        self.group = state.pipeline_group
        self.ranks = state.group_ranks["pp"]
        self.me = self.ranks[self.stage]
        self.delay = faults.link_delay()
        self.trace = _trace.full()
        self.p, self.m = schedule.stages, schedule.microbatches
        self.shape, self.dtype, self.device = shape, dtype, device
        # Scatter/gather over the tensor group: this rank's slice of the
        # flattened tensor travels; the receiver all-gathers the slices.
        tp = state.tp_size
        self.split = (tp if scatter_gather and tp > 1 and shape is not None
                      and math.prod(shape) % tp == 0 else 1)
        self.tensor_group, self.tp_rank = state.tensor_group, state.tp_rank
        self.message = (shape if self.split == 1 or shape is None
                        else (math.prod(shape) // self.split,))
        # On one node, CPU tensors move through shared memory (ShmP2P), not
        # Gloo's TCP loopback; peers are addressed by stage = pipeline-group rank.
        # A message larger than a ring would move only while the sender is in
        # a p2p call (Gloo moves it from its own threads): those stay on Gloo.
        # Every stage decides alike: shape and dtype are the same everywhere.
        self.shm = (self.group is not None and (device is None or device.type == "cpu")
                    and shape is not None and shared_memory_enabled(self.group, p2p=True)
                    and math.prod(self.message) * dtype.itemsize <= torch.ops.mapp.shm_p2p_ring_bytes(
                        self.group.group_name))
        self.recvs: dict = {}
        # key -> (work, tensor): the tensor lives until the send is waited on
        self.sends: dict = {}
        self.result: PipelineResult | None = None

    def tag(self, kind: int, mb: int, vstage: int) -> int:
        return (vstage * self.m + mb) * 2 + kind

    def post_recv(self, key, peer: int) -> None:
        if self.shape is None:
            raise ValueError("forward_backward: tensor_shape is required with more than one "
                             "pipeline stage (the shape of the activations between stages, "
                             "e.g. (seq_length, micro_batch_size, hidden_size))")
        buf = torch.empty(self.message, dtype=self.dtype, device=self.device)
        src, tag = self.ranks[peer], self.tag(*key)
        t0 = time.monotonic_ns()
        if self.shm:
            work = torch.ops.mapp.shm_irecv(buf, self.group.group_name, peer, tag)
        else:
            work = dist.irecv(buf, src=src, group=self.group, tag=tag)
        if self.trace:  # a transfer cannot complete before its receive is posted
            _trace.record("recv_post", "p2p", t0, time.monotonic_ns(), lane=2, mb=key[1],
                          peer=src, group=f"p2p:{src}->{self.me}", seq=tag)
        self.recvs[key] = (work, buf)

    def wait_recv(self, key, peer: int) -> torch.Tensor:
        work, buf = self.recvs.pop(key)
        t0 = time.monotonic_ns()
        work.wait()
        t1 = time.monotonic_ns()
        if key[0] == 1:
            # The gradient of microbatch mb came back: the next stage ran that
            # microbatch's forward, so our activation send to it completed;
            # release it now instead of holding every output until finish().
            done = self.sends.pop((0, key[1], key[2] + 1), None)
            if done is not None:
                done[0].wait()
        self.result.recv_wait_time += (t1 - t0) / 1e9
        if self.trace:
            src = self.ranks[peer]
            _trace.record("recv_wait", "p2p", t0, t1, mb=key[1], peer=src,
                          bytes=buf.numel() * buf.element_size(), group=f"p2p:{src}->{self.me}",
                          seq=self.tag(*key))
        if self.split > 1:  # every tensor rank received its slice: put them together
            buf = _collectives.all_gather(buf, 0, self.tensor_group).view(self.shape)
        return buf

    def send(self, key, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.detach().contiguous()
        if tuple(tensor.shape) != tuple(self.shape) or tensor.dtype != self.dtype:
            raise ValueError(
                f"forward_backward: a stage produced a tensor of shape {tuple(tensor.shape)} "
                f"and dtype {tensor.dtype} but tensor_shape={tuple(self.shape)}, "
                f"dtype={self.dtype} were given; every stage boundary must match them")
        if self.split > 1:
            k = tensor.numel() // self.split
            tensor = tensor.view(-1).narrow(0, self.tp_rank * k, k)
        dst, tag = self.ranks[peer], self.tag(*key)
        self.result.sent_bytes += tensor.numel() * tensor.element_size()
        t0 = time.monotonic_ns()
        if self.shm:
            def issue(tensor=tensor, peer=peer, tag=tag, name=self.group.group_name):
                return torch.ops.mapp.shm_isend(tensor, name, peer, tag)
        else:
            def issue(tensor=tensor, dst=dst, tag=tag, group=self.group):
                return dist.isend(tensor, dst=dst, group=group, tag=tag)
        if self.delay is not None and self.delay["rank"] == self.me and self.delay["peer"] == dst:
            work = _DelayedSend(issue, self.delay["ms"] / 1e3)
        else:
            work = issue()
        if self.trace:
            _trace.record("send", "p2p", t0, time.monotonic_ns(), lane=2, mb=key[1], peer=dst,
                          bytes=tensor.numel() * tensor.element_size(),
                          group=f"p2p:{self.me}->{dst}", seq=tag)
        self.sends[key] = (work, tensor)

    def finish(self) -> None:
        for work, _ in self.sends.values():
            work.wait()  # exactly once: a second wait on a Gloo send never returns
        self.sends = {}
        if self.recvs:
            raise RuntimeError(f"forward_backward: receives posted but never used: {list(self.recvs)}")


class _DelayedSend:
    """A send `issue()`d `delay` seconds later from a timer thread (fault
    injection of a slow link: the sender does not wait)."""

    def __init__(self, issue, delay):
        self._work = None
        self._error = None
        self._thread = threading.Timer(delay, self._issue, (issue,))
        self._thread.start()

    def _issue(self, issue):
        try:
            self._work = issue()
        except Exception as e:  # surfaced by wait()
            self._error = e

    def wait(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._work.wait()


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


def _recv_peers(actions):
    """index of an F / B / BI action -> the peer stage its input comes from
    (from this stage's RECV actions)."""
    peers = {}  # (kind, mb, chunk) -> peer stage
    for a in actions:
        if a.type in ("RECV_ACT", "RECV_GRAD"):
            peers[(0 if a.type == "RECV_ACT" else 1, a.microbatch, a.chunk)] = a.peer

    def peer_of(i):
        a = actions[i]
        return peers[(0 if a.type == "F" else 1, a.microbatch, a.chunk)]
    return peer_of


def _final_backwards(actions, chunks: int) -> set:
    """Indices of the actions during which a chunk's DDP must synchronize: its
    last B/BI (gradients of non-deferred parameters) and its last B/W (matmul
    weights)."""
    last_input, last_weight, kinds = {}, {}, defaultdict(set)
    for i, a in enumerate(actions):
        if a.type in ("B", "BI"):
            last_input[a.chunk] = i
            kinds[a.chunk].add(a.type)
        if a.type in ("B", "W"):
            last_weight[a.chunk] = i
    for c, k in kinds.items():
        if len(k) > 1:
            raise ValueError(f"forward_backward: chunk {c} mixes full backwards (B) and split "
                             "ones (BI/W) on one stage; use one kind per chunk")
    return set(last_input.values()) | set(last_weight.values())


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
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    if p != state.pp_size:
        raise ValueError(f"forward_backward: schedule '{schedule.name}' has {p} stages but the "
                         f"pipeline-parallel size is {state.pp_size}")
    if len(chunks) != v:
        raise ValueError(f"forward_backward: schedule '{schedule.name}' has {v} chunks per stage "
                         f"but {len(chunks)} model chunks were given")
    stage = state.pp_rank
    actions = schedule.actions(stage)
    if forward_only:
        actions = [a for a in actions if a.type in ("F", "SEND_ACT", "RECV_ACT")]
    device = next(iter(chunks[0].parameters())).device
    result = PipelineResult(tensor_shape=tuple(tensor_shape) if tensor_shape else None,
                            dtype=dtype, device=device)
    p2p = _P2P(state, schedule, tensor_shape, dtype, device, scatter_gather)
    p2p.result = result
    final = set() if forward_only else _final_backwards(actions, v)
    syncs = [c if isinstance(c, GradSync) else None for c in chunks]
    last_vs = p * v - 1
    vstage = [schedule.vstage(stage, c) for c in range(v)]
    # hand-offs between two chunks of this stage (wave placement), by virtual stage
    local_in = [vs > 0 and schedule.stage_of(vs - 1) == stage for vs in vstage]
    local_out = [vs < last_vs and schedule.stage_of(vs + 1) == stage for vs in vstage]
    handed: dict = {}  # (kind, mb, consuming vstage) -> tensor
    batch = _Batches(data_iterator)
    a_peer = _recv_peers(actions)

    stash: dict = {}  # (mb, chunk) -> (input, output)
    wstore: dict = {}  # (mb, chunk) -> WeightGradStore
    live = 0
    times = defaultdict(list)
    t_step = time.perf_counter()
    with contextlib.ExitStack() as deferred:
        if forward_only:
            deferred.enter_context(torch.no_grad())
        else:
            for d in syncs:
                if d is not None:
                    deferred.enter_context(d.deferred_grad_sync())
        for i, a in enumerate(actions):
            mb, c = a.microbatch, a.chunk
            vs = vstage[c]
            if a.type == "RECV_ACT":
                p2p.post_recv((0, mb, vs), a.peer)
            elif a.type == "RECV_GRAD":
                p2p.post_recv((1, mb, vs), a.peer)
            elif a.type == "SEND_ACT":
                entry = stash.pop((mb, c)) if forward_only else stash[(mb, c)]
                p2p.send((0, mb, vs + 1), entry[1], a.peer)
            elif a.type == "SEND_GRAD":
                p2p.send((1, mb, vs - 1), stash.pop((mb, c))[0].grad, a.peer)
            else:
                if a.type == "F":
                    if vs == 0:
                        x = batch(mb)[0]
                    elif local_in[c]:
                        x = handed.pop((0, mb, vs))
                    else:
                        x = p2p.wait_recv((0, mb, vs), a_peer(i))
                    if vs > 0 and not forward_only:
                        x.requires_grad_(True)
                elif a.type in ("B", "BI") and vs < last_vs:
                    dy = (handed.pop((1, mb, vs)) if local_out[c]
                          else p2p.wait_recv((1, mb, vs), a_peer(i)))
                t0 = time.perf_counter()
                t0_ns = time.monotonic_ns() if p2p.trace else 0
                busy = _trace.BusyTimer() if p2p.trace else None
                if a.type == "F":
                    out = chunks[c](x, **batch.kwargs(mb))
                    if vs == last_vs:
                        loss = loss_fn(out, batch(mb)[1])
                        result.losses.append(loss.detach())
                        out = loss / m
                    if local_out[c]:  # as if sent: a copy, so the two chunks share no storage
                        handed[(0, mb, vs + 1)] = out.detach().clone()
                    if not (forward_only and (vs == last_vs or local_out[c])):
                        stash[(mb, c)] = (x, out)
                    live += 1
                    result.peak_activations = max(result.peak_activations, live)
                else:
                    sync = (contextlib.nullcontext() if syncs[c] is None or i in final
                            else syncs[c].no_sync())
                    with sync:
                        if a.type == "W":
                            autograd.run(wstore.pop((mb, c)))
                            live -= 1
                        else:
                            x, out = stash[(mb, c)]
                            grad = None if vs == last_vs else dy
                            if a.type == "BI":
                                store = wstore[(mb, c)] = autograd.WeightGradStore()
                                with autograd.deferring(store):
                                    torch.autograd.backward(out, grad)
                            else:
                                torch.autograd.backward(out, grad)
                                live -= 1
                            if vs == 0:
                                stash.pop((mb, c))
                            elif local_in[c]:
                                handed[(1, mb, vs - 1)] = stash.pop((mb, c))[0].grad
                            else:
                                stash[(mb, c)] = (x, None)
                times[a.type].append(time.perf_counter() - t0)
                if p2p.trace:
                    busy.record(_TRACE_NAMES[a.type], "compute", t0_ns, time.monotonic_ns(), mb=mb, chunk=c)
        p2p.finish()
        if handed:
            raise RuntimeError(f"forward_backward: hand-offs between chunks never used: {list(handed)}")
        for d in syncs:
            if d is not None and not forward_only:
                d.finish_grad_sync()
    return _finish(result, times, t_step)


def _finish(result: PipelineResult, times, t_step) -> PipelineResult:
    result.compute_time = {k: statistics.fmean(v) for k, v in times.items()}
    result.step_time = time.perf_counter() - t_step
    return result
