"""MegaFBD: forward/backward disaggregation (docs/fbd.md).

With ratio ``F:B`` the data-parallel ranks of every (tensor, pipeline)
coordinate are split into FBD groups of F + B consecutive data-parallel
ranks: the first F are *forward* ranks, the next B *backward* ranks (a
documented split of the data-parallel dimension; tensor, pipeline and model
groups stay role-pure, so forward pipelines and backward pipelines are whole
pipelines).

* A forward rank runs its stage without autograd (activations freed at once)
  and ships the stage output both down its own forward pipeline and to the
  backward rank that owns the same microbatch one stage further.
* A backward rank receives its stage input, re-runs the stage forward with
  autograd (the recomputation) and runs the backward; input gradients flow
  up its backward pipeline. Backward ranks are the training replicas: they
  hold gradients and the optimizer (DDP / ZeRO-1 / codecs over the backward
  ranks only) and, after each step, broadcast the new weights to the forward
  ranks of their group.

The FBD group's microbatches are those its F + B data-parallel ranks would
have had without FBD, so the global batch, the losses and the gradients are
the ones of 1F1B with full recomputation (tested to 1e-6). Microbatch j of a
group goes to forward rank j mod F and backward rank j mod B.

    layout = FBDLayout(dp=4, forward=1, backward=1)
    prog = program(layout, p=2, microbatches=8)   # the schedule as data
    prog.actions("backward", 0, stage=1)           # [FBDAction('RECV_INPUT', 0, ...), ...]
    sim = simulate(prog, forward=[..], backward=[..], p2p=..)   # makespan per step
    choose_ratio(ranks=6, p=2, microbatches=..., forward=.., backward=..)
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import time
from dataclasses import dataclass, field

import torch.distributed as dist

import torch

from .. import trace as _trace
from .._C import Coord
from ..parallel_state import ParallelState, enable_shared_memory, new_groups
from .executor import to_device
from .schedules import per_stage

__all__ = ["FBDLayout", "FBDAction", "FBDProgram", "FBDParallelState", "FBDSimulation",
           "parse_ratio", "program", "simulate", "choose_ratio", "fbd_parallel_state",
           "run_step", "broadcast_weights"]

FORWARD, BACKWARD = "forward", "backward"


def parse_ratio(text: str) -> tuple[int, int]:
    """``"1:2"`` -> (1, 2): forward ranks : backward ranks per FBD group."""
    try:
        f, b = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise ValueError(f"--fbd-ratio '{text}': expected FORWARD:BACKWARD, two positive "
                         "integers such as 1:1, 1:2 or 2:1") from None
    if f < 1 or b < 1:
        raise ValueError(f"--fbd-ratio '{text}': both sides must be >= 1 (forward ranks feed "
                         "backward ranks; a group needs at least one of each)")
    return f, b


@dataclass(frozen=True)
class FBDLayout:
    """The split of `dp` data-parallel ranks into FBD groups of
    ``forward + backward`` ranks."""

    dp: int
    forward: int
    backward: int

    def __post_init__(self):
        n = self.forward + self.backward
        if self.forward < 1 or self.backward < 1:
            raise ValueError("FBD needs at least one forward and one backward rank per group")
        if self.dp % n:
            raise ValueError(
                f"--fbd-ratio {self.forward}:{self.backward} needs the data-parallel size to be a "
                f"multiple of {n} (forward + backward ranks per group); it is {self.dp}. Use a "
                f"world of tp x pp x {n * max(1, self.dp // n)} ranks or another ratio")

    @property
    def group_size(self) -> int:
        return self.forward + self.backward

    @property
    def groups(self) -> int:
        return self.dp // self.group_size

    @property
    def backward_replicas(self) -> int:
        """The training replicas (data-parallel size of the gradients)."""
        return self.groups * self.backward

    def role(self, dp_rank: int) -> tuple[str, int, int]:
        """(role, index within the role of its group, group) of a data-parallel rank."""
        g, k = divmod(dp_rank, self.group_size)
        return (FORWARD, k, g) if k < self.forward else (BACKWARD, k - self.forward, g)

    def dp_rank_of(self, role: str, index: int, group: int) -> int:
        return group * self.group_size + (index if role == FORWARD else self.forward + index)

    def microbatches(self, role: str, index: int, total: int) -> list[int]:
        """The group microbatches (of `total`) that this role index handles."""
        n = self.forward if role == FORWARD else self.backward
        return list(range(index, total, n))


@dataclass(frozen=True)
class FBDAction:
    """One step of a rank's FBD program. ``F``: forward without autograd;
    ``R``: forward with autograd (the recomputation; the last stage adds the
    loss); ``B``: backward. Transfers name the peer as (role, index, stage):
    ACT between forward ranks, INPUT forward -> backward, GRAD between
    backward ranks."""

    type: str
    microbatch: int
    peer: tuple | None = None


_KIND = {"ACT": 1, "INPUT": 2, "GRAD": 3}


@dataclass
class FBDProgram:
    """Per (role, index, stage) the ordered actions of one step."""

    layout: FBDLayout
    stages: int
    microbatches: int  #: per FBD group and step
    table: dict = field(repr=False, default_factory=dict)

    @property
    def name(self) -> str:
        return f"fbd {self.layout.forward}:{self.layout.backward}"

    def actions(self, role: str, index: int, stage: int) -> list[FBDAction]:
        return self.table[(role, index, stage)]


def program(layout: FBDLayout, p: int, microbatches: int) -> FBDProgram:
    """The FBD schedule of one group: `microbatches` per group and step over
    `p` pipeline stages. Forward ranks of the last stage have nothing to do
    (the backward ranks recompute that stage from its input)."""
    if p < 2:
        raise ValueError("forward/backward disaggregation needs pipeline parallelism "
                         "(--pipeline-model-parallel-size >= 2): with one stage a forward rank "
                         "has nothing to compute ahead of the backward rank")
    if microbatches % layout.backward or microbatches % layout.forward:
        raise ValueError(
            f"{microbatches} microbatches per FBD group do not split evenly over "
            f"{layout.forward} forward and {layout.backward} backward ranks; change "
            "--global-batch-size or --fbd-ratio")
    f, b = layout.forward, layout.backward
    table = {}
    for k in range(f):
        for s in range(p):
            acts = []
            if s < p - 1:
                for j in layout.microbatches(FORWARD, k, microbatches):
                    if s > 0:
                        acts.append(FBDAction("RECV_ACT", j, (FORWARD, k, s - 1)))
                    acts.append(FBDAction("F", j))
                    acts.append(FBDAction("SEND_INPUT", j, (BACKWARD, j % b, s + 1)))
                    if s + 1 < p - 1:
                        acts.append(FBDAction("SEND_ACT", j, (FORWARD, k, s + 1)))
            table[(FORWARD, k, s)] = acts
    for i in range(b):
        for s in range(p):
            acts = []
            for j in layout.microbatches(BACKWARD, i, microbatches):
                if s > 0:
                    acts.append(FBDAction("RECV_INPUT", j, (FORWARD, j % f, s - 1)))
                acts.append(FBDAction("R", j))
                if s < p - 1:
                    acts.append(FBDAction("RECV_GRAD", j, (BACKWARD, i, s + 1)))
                acts.append(FBDAction("B", j))
                if s > 0:
                    acts.append(FBDAction("SEND_GRAD", j, (BACKWARD, i, s - 1)))
            table[(BACKWARD, i, s)] = acts
    return FBDProgram(layout, p, microbatches, table)


# ---- simulation and the planner -------------------------------------------------------
@dataclass
class FBDSimulation:
    makespan: float  #: one step, without the weight broadcast
    busy: dict  #: (role, index, stage) -> compute seconds
    step: float  #: makespan + weight broadcast


def simulate(prog: FBDProgram, forward, backward, p2p=0.0, *, recompute=None,
             weight_sync=0.0, forward_slowdown: float = 1.0) -> FBDSimulation:
    """Event-driven simulation of one group's step (executor semantics: sends
    never block, a compute action waits for its input). Per stage (numbers or
    per-stage lists, seconds): `forward`, a forward rank's no-autograd
    forward; `recompute`, a backward rank's forward with autograd (default:
    `forward`); `backward`, its backward. `p2p`: one transfer;
    `weight_sync`: the broadcast after the optimizer step;
    `forward_slowdown` scales the forward ranks' compute (slower devices)."""
    p = prog.stages
    fwd = [t * forward_slowdown for t in per_stage(forward, p, "forward")]
    rec = per_stage(forward if recompute is None else recompute, p, "recompute")
    bwd = per_stage(backward, p, "backward")
    arrive = {}  # (kind, mb, receiver) -> time
    clock = {key: 0.0 for key in prog.table}
    pos = dict.fromkeys(prog.table, 0)
    busy = dict.fromkeys(prog.table, 0.0)
    ready = [(0.0, key) for key in prog.table]
    heapq.heapify(ready)
    pending = {}  # what a blocked rank waits for -> its key
    while ready:
        _, key = heapq.heappop(ready)
        role, idx, s = key
        acts = prog.table[key]
        while pos[key] < len(acts):
            a = acts[pos[key]]
            if a.type.startswith("RECV_"):
                kind = a.type[5:]
                token = (kind, a.microbatch, key)
                if token not in arrive:
                    pending[token] = key
                    break
                clock[key] = max(clock[key], arrive[token])
            elif a.type.startswith("SEND_"):
                kind = a.type[5:]
                token = (kind, a.microbatch, a.peer)
                arrive[token] = clock[key] + p2p
                if token in pending:
                    heapq.heappush(ready, (arrive[token], pending.pop(token)))
            else:
                cost = {"F": fwd, "R": rec, "B": bwd}[a.type][s]
                clock[key] += cost
                busy[key] += cost
            pos[key] += 1
    if pending:
        raise RuntimeError(f"FBD program deadlocks: {sorted(pending.values())[:3]} wait forever")
    makespan = max(clock.values()) if clock else 0.0
    return FBDSimulation(makespan, busy, makespan + weight_sync)


def choose_ratio(ranks: int, p: int, microbatches: int, forward, backward, p2p=0.0, *,
                 recompute=None, weight_sync=0.0, forward_slowdown: float = 1.0) -> list[dict]:
    """Every FBD ratio that fits `ranks` pipelines' worth of data-parallel
    ranks (one FBD group of ``ranks`` ranks per pipeline coordinate), with its
    predicted step time for a global batch of `microbatches` microbatches,
    best (fastest) first. Times as in :func:`simulate`."""
    out = []
    for f in range(1, ranks):
        b = ranks - f
        if microbatches % f or microbatches % b:
            continue
        prog = program(FBDLayout(ranks, f, b), p, microbatches)
        sim = simulate(prog, forward, backward, p2p, recompute=recompute,
                       weight_sync=weight_sync, forward_slowdown=forward_slowdown)
        out.append({"ratio": f"{f}:{b}", "forward": f, "backward": b, "step": sim.step,
                    "makespan": sim.makespan})
    return sorted(out, key=lambda r: r["step"])


# ---- the process groups ---------------------------------------------------------------
@dataclass
class FBDParallelState(ParallelState):
    """A :class:`ParallelState` whose data group is this rank's role: the
    backward ranks' (gradients, ZeRO-1) or the forward ranks'. ``dp_rank`` /
    ``dp_size`` count the backward ranks (the training replicas); a forward
    rank's ``dp_rank`` is past them, so it never owns a checkpoint piece."""

    fbd: FBDLayout | None = None
    fbd_role: str = BACKWARD
    fbd_index: int = 0
    fbd_group: int = 0
    fbd_dp_rank: int = 0
    #: this FBD group's forward ranks + its first backward rank (the source);
    #: None on the group's other backward ranks
    weight_group: dist.ProcessGroup | None = None
    weight_src: int = 0

    @property
    def dp_rank(self) -> int:
        return self.fbd_dp_rank

    @property
    def dp_size(self) -> int:
        return self.fbd.backward_replicas

    @property
    def is_forward(self) -> bool:
        return self.fbd_role == FORWARD

    def peer_rank(self, role: str, index: int, stage: int) -> int:
        """The global rank of (role, index, stage) in this rank's FBD group."""
        c = self.grid.coord(self.rank)
        return self.grid.rank(Coord(c.tp, c.cp, self.fbd.dp_rank_of(role, index, self.fbd_group),
                                    stage))


def fbd_parallel_state(state: ParallelState, forward: int, backward: int,
                       backend=None) -> FBDParallelState:
    """Collective: the role groups of an F:B split of `state`'s data-parallel
    ranks, and this rank's :class:`FBDParallelState`."""
    if state.cp_size > 1 or state.ep_size > 1 or state.etp_size != state.tp_size:
        raise ValueError("forward/backward disaggregation does not run with context or expert "
                         "parallelism yet; drop --context-parallel-size / "
                         "--expert-model-parallel-size / --expert-tensor-parallel-size or "
                         "--forward-backward-disaggregating")
    layout = FBDLayout(state.dp_size, forward, backward)
    rank = state.rank
    role, index, group = layout.role(state.grid.coord(rank).dp)
    dp_lists = state.grid.groups(["dp"])  # ordered by data-parallel coordinate
    weights = []
    for ranks in dp_lists:
        for g in range(layout.groups):
            base = g * layout.group_size
            weights.append(ranks[base:base + forward] + [ranks[base + forward]])
    role_lists = []
    for ranks in dp_lists:
        for want in (FORWARD, BACKWARD):
            role_lists.append([r for d, r in enumerate(ranks) if layout.role(d)[0] == want])
    data_group, data_ranks = new_groups(role_lists, rank, backend)
    weight_group, weight_ranks = new_groups(weights, rank, backend)
    enable_shared_memory(data_group)
    if role == BACKWARD:
        dp_rank = group * backward + index
    else:
        dp_rank = layout.backward_replicas + group * forward + index
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(ParallelState)}
    fields["data_group"] = data_group
    fields["group_ranks"] = {**state.group_ranks, "dp": data_ranks, "edp": data_ranks,
                             "fbd_weights": weight_ranks}
    return FBDParallelState(**fields, fbd=layout, fbd_role=role, fbd_index=index,
                            fbd_group=group, fbd_dp_rank=dp_rank, weight_group=weight_group,
                            weight_src=weight_ranks[-1] if weight_ranks else -1)


def broadcast_weights(chunks, state: FBDParallelState) -> None:
    """After the optimizer step: the group's first backward rank sends every
    parameter and floating-point buffer to the group's forward ranks (one
    coalesced broadcast per dtype; other backward ranks do nothing)."""
    if state.weight_group is None:
        return
    params = [p for c in chunks for p in _module(c).parameters()]
    params += [b for c in chunks for b in _module(c).buffers() if b.is_floating_point()]
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    with _trace.scope("fbd-weights", "collective", lane=0), torch.no_grad():
        for ps_ in by_dtype.values():
            flat = torch.cat([p.detach().reshape(-1) for p in ps_])
            dist.broadcast(flat, src=state.weight_src, group=state.weight_group)
            if state.is_forward:
                off = 0
                for p in ps_:
                    p.copy_(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()


def _module(c):
    return getattr(c, "module", c)


# ---- the executor ---------------------------------------------------------------------
@dataclass
class FBDResult:
    losses: list = field(default_factory=list)  #: last backward stage: per microbatch
    compute_time: dict = field(default_factory=dict)  #: type -> mean seconds per action
    recv_wait_time: float = 0.0
    step_time: float = 0.0
    #: most stage inputs held at once (receive buffers, posted at the step's start, included)
    stash_peak: int = 0


def run_step(prog: FBDProgram, state: FBDParallelState, chunks, batch, loss_fn, *,
             tensor_shape, dtype, device, grad_scale: float = 1.0, reseed=None) -> FBDResult:
    """This rank's part of one FBD step. `batch(j)` gives group microbatch j
    as ``(inputs, target)``; `loss_fn(output, target)` on the last stage.
    Backward ranks divide each loss by their microbatch count (gradients are
    the mean over the global batch after the backward ranks' average).
    `reseed(j)`, if given, runs before each forward and recomputation of j
    (dropout: both roles draw the same masks)."""
    role, idx, s = state.fbd_role, state.fbd_index, state.pp_rank
    acts = prog.actions(role, idx, s)
    p = prog.stages
    res = FBDResult()
    n_mine = len(prog.layout.microbatches(role, idx, prog.microbatches))
    chunk = chunks[0]
    recvs, sends, times = {}, [], {}
    t_step = time.perf_counter()

    def tag(kind, j):
        return _KIND[kind] * 1_000_000 + j

    for a in acts:  # post every receive up front: the senders never wait
        if a.type.startswith("RECV_"):
            kind = a.type[5:]
            buf = torch.empty(tensor_shape, dtype=dtype, device=device)
            recvs[(kind, a.microbatch)] = (buf, dist.irecv(
                buf, src=state.peer_rank(*a.peer), tag=tag(kind, a.microbatch)))

    def wait(kind, j):
        buf, work = recvs.pop((kind, j))
        t0 = time.perf_counter()
        work.wait()
        res.recv_wait_time += time.perf_counter() - t0
        return buf

    def send(kind, j, t, peer):
        t = t.detach().contiguous()
        sends.append((t, dist.isend(t, dst=state.peer_rank(*peer), tag=tag(kind, j))))

    def timed(name, fn):
        t0 = time.perf_counter()
        with _trace.scope(name, "compute", mb=j):
            out = fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    # a forward rank's output of microbatch j is freed after its last send
    last_send = {a.microbatch: i for i, a in enumerate(acts)
                 if a.type in ("SEND_INPUT", "SEND_ACT")}
    sync = chunk if hasattr(chunk, "no_sync") else None
    backwards_left = sum(a.type == "B" for a in acts)
    stash = {}
    with contextlib.ExitStack() as stack:
        if sync is not None:
            stack.enter_context(sync.deferred_grad_sync())
        for i, a in enumerate(acts):
            j = a.microbatch
            if a.type == "RECV_ACT" or a.type == "RECV_INPUT":
                stash[j] = wait(a.type[5:], j)
                res.stash_peak = max(res.stash_peak, len(stash) + len(recvs))
            elif a.type == "F":
                x = to_device(batch(j)[0], device) if s == 0 else stash.pop(j)
                if reseed is not None:
                    reseed(j)
                with torch.no_grad():
                    stash[j] = timed("forward", lambda x=x: chunk(x))
            elif a.type == "SEND_INPUT":
                send("INPUT", j, stash[j], a.peer)
            elif a.type == "SEND_ACT":
                send("ACT", j, stash[j], a.peer)
            elif a.type == "R":
                x = to_device(batch(j)[0], device) if s == 0 else stash.pop(j).requires_grad_(True)
                if reseed is not None:
                    reseed(j)

                def fwd(x=x):
                    out = chunk(x)
                    if s == p - 1:
                        loss = loss_fn(out, batch(j)[1])
                        res.losses.append(loss.detach() / grad_scale)
                        out = loss / n_mine
                    return out
                stash[j] = (x, timed("recompute", fwd))
            elif a.type == "RECV_GRAD":
                stash[("dy", j)] = wait("GRAD", j)
            elif a.type == "B":
                x, out = stash.pop(j)
                dy = stash.pop(("dy", j), None)
                backwards_left -= 1
                ctx = (sync.no_sync() if sync is not None and backwards_left > 0
                       else contextlib.nullcontext())
                with ctx:
                    timed("backward", lambda: torch.autograd.backward(out, dy))
                if s > 0:
                    stash[("dx", j)] = x.grad
            elif a.type == "SEND_GRAD":
                send("GRAD", j, stash.pop(("dx", j)), a.peer)
            if i == last_send.get(j):  # the output has gone everywhere it goes
                stash.pop(j, None)
        for _, work in sends:
            work.wait()
        if sync is not None:
            sync.finish_grad_sync()
    res.compute_time = {k: sum(v) / len(v) for k, v in times.items()}
    res.step_time = time.perf_counter() - t_step
    return res
