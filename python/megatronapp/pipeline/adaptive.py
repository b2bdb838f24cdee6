"""Adaptive re-planning: the dynamic planner fed with measured times.

    sched = AdaptiveSchedule(p, m, interval=10)
    for step in range(steps):
        result = forward_backward(sched.schedule, chunks, data, loss_fn, tensor_shape=...)
        sched.observe(result)

Every rank records its own stage's mean F / BI / W times. Every `interval`
steps, each link s <-> s+1 is timed by a short ping-pong of one activation
between its two stages (a probe: send completion cannot be observed reliably
on every backend while a step runs), then one all-reduce over the world (not
one per decision) averages stage and link times, and every rank re-plans
``Schedule.dynamic(policy="adaptive", costs=measured)`` — the same
deterministic computation on the same numbers, so every rank (and every
data-parallel replica) gets the same plan. A full backward B is split evenly
between BI and W for the model.
"""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist

import torch

from ..parallel_state import ParallelState, resolve_state
from .executor import PipelineResult
from .schedules import Schedule, costs

__all__ = ["AdaptiveSchedule", "current_schedule", "make_schedule"]


class AdaptiveSchedule:
    def __init__(self, p: int, m: int, v: int = 1, memory_limit: int | None = None,
                 interval: int = 10, parallel_state: ParallelState | None = None):
        if interval < 1:
            raise ValueError(f"AdaptiveSchedule: interval must be >= 1, got {interval}")
        self.p, self.m, self.v, self.memory_limit, self.interval = p, m, v, memory_limit, interval
        self.state = parallel_state
        self.schedule = Schedule.dynamic(p, m, v, "adaptive", memory_limit)
        self.costs = None  #: the measured costs of the last re-plan
        self.replans = 0
        self._reset()

    def _reset(self) -> None:
        # columns: F, BI, W, samples; then per link: p2p sum, samples
        self._stage = torch.zeros(self.p, 4, dtype=torch.float64)
        self._link = torch.zeros(self.p, 2, dtype=torch.float64)
        self._steps = 0

    def observe(self, result: PipelineResult) -> bool:
        """Records one step; every `interval` calls re-plans (collective over the
        world: call it on every rank). Returns True when the schedule changed."""
        state = resolve_state(self.state)
        stage = state.pp_rank
        t = result.compute_time
        if "B" in t:
            bi = bw = t["B"] / 2
        else:
            bi, bw = t.get("BI", 0.0), t.get("W", 0.0)
        self._stage[stage] += torch.tensor([t.get("F", 0.0), bi, bw, 1.0], dtype=torch.float64)
        self._steps += 1
        if self._steps < self.interval:
            return False
        if result.tensor_shape is not None and self.p > 1:
            self._probe_links(state, result.tensor_shape, result.dtype, result.device)
        both = torch.cat([self._stage.flatten(), self._link.flatten()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both)
        stage_t = both[: self.p * 4].view(self.p, 4)
        link_t = both[self.p * 4:].view(self.p, 2)
        n = stage_t[:, 3].clamp(min=1)
        f, bi, bw = (stage_t[:, i] / n for i in range(3))
        p2p = link_t[:, 0] / link_t[:, 1].clamp(min=1)
        self.costs = costs(self.p, f.tolist(), bi.tolist(), bw.tolist(), p2p.tolist())
        old = [self.schedule.actions(s) for s in range(self.p)]
        self.schedule = Schedule.dynamic(self.p, self.m, self.v, "adaptive", self.memory_limit,
                                         self.costs)
        self.replans += 1
        self._reset()
        return old != [self.schedule.actions(s) for s in range(self.p)]

    def _probe_links(self, state, shape, dtype, device, rounds: int = 3) -> None:
        """Median one-way time of one activation over each link this rank
        touches (links in increasing order on every rank: no deadlock)."""
        stage, ranks = state.pp_rank, state.group_ranks["pp"]
        buf = torch.zeros(shape, dtype=dtype, device=device)
        for link in range(self.p if self.v > 1 else self.p - 1):
            a, b = link, (link + 1) % self.p
            if stage not in (a, b) or a == b:
                continue
            peer = ranks[b if stage == a else a]
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                if stage == a:
                    dist.send(buf, peer, group=state.pipeline_group)
                    dist.recv(buf, peer, group=state.pipeline_group)
                else:
                    dist.recv(buf, peer, group=state.pipeline_group)
                    dist.send(buf, peer, group=state.pipeline_group)
                times.append((time.perf_counter() - t0) / 2)
            if stage == a:  # count each link once
                self._link[link] += torch.tensor([statistics.median(times), 1.0],
                                                 dtype=torch.float64)


def make_schedule(name: str, p: int, m: int, v: int = 1, *, policy: str = "adaptive",
                  memory_limit: int | None = None, replan_interval: int = 20,
                  parallel_state: ParallelState | None = None):
    """The schedule ``pretrain_gpt.py --pipeline-schedule NAME`` runs: a
    :class:`Schedule`, or with ``dynamic`` and policy ``adaptive`` an
    :class:`AdaptiveSchedule` re-planning every `replan_interval` steps. One
    stage (p = 1) is always the one-stage 1F1B (forward, backward per
    microbatch). Raises ValueError for combinations that cannot run."""
    if p == 1:
        return Schedule.one_f_one_b(1, m)
    if name == "dynamic":
        if policy == "adaptive":
            return AdaptiveSchedule(p, m, v, memory_limit, interval=replan_interval,
                                    parallel_state=parallel_state)
        return Schedule.dynamic(p, m, v, policy, memory_limit)
    return Schedule.by_name(name, p, m, v)


def current_schedule(schedule) -> Schedule:
    """The schedule to run now (an AdaptiveSchedule's latest plan)."""
    return schedule.schedule if isinstance(schedule, AdaptiveSchedule) else schedule
