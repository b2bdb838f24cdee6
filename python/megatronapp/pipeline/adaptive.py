"""Adaptive re-planning: the dynamic planner fed with measured times.

    sched = AdaptiveSchedule(p, m, interval=10)
    for step in range(steps):
        result = forward_backward(sched.schedule, chunks, data, loss_fn, tensor_shape=...)
        sched.observe(result)

A front-end over the C++ engine's ``mapp::AdaptiveSchedule`` (shared with C++
trainers). Every rank records its own stage's mean F / BI / W times. Every
`interval` steps, each link s <-> s+1 is timed by a short ping-pong of one
activation between its two stages (a probe: send completion cannot be
observed reliably on every backend while a step runs), then one all-reduce
over the world (not one per decision) averages stage and link times, and
every rank re-plans ``Schedule.dynamic(policy="adaptive", costs=measured)`` —
the same deterministic computation on the same numbers, so every rank (and
every data-parallel replica) gets the same plan. A full backward B is split
evenly between BI and W for the model.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

from .. import _C
from ..parallel_state import ParallelState, resolve_state
from .executor import PipelineResult, pipeline_groups
from .schedules import Schedule

__all__ = ["AdaptiveSchedule", "current_schedule", "make_schedule"]


class AdaptiveSchedule:
    def __init__(self, p: int, m: int, v: int = 1, memory_limit: int | None = None,
                 interval: int = 10, parallel_state: ParallelState | None = None):
        if interval < 1:
            raise ValueError(f"AdaptiveSchedule: interval must be >= 1, got {interval}")
        self.p, self.m, self.v, self.memory_limit, self.interval = p, m, v, memory_limit, interval
        self.state = parallel_state
        self.schedule = Schedule.dynamic(p, m, v, "adaptive", memory_limit)
        # The engine joins the groups at the first observe() (a schedule may be
        # planned before initialize_model_parallel, e.g. to validate flags).
        self._engine = None

    @property
    def costs(self):
        """The measured costs (``_C.pipeline.Costs``) of the last re-plan, or None."""
        return None if self._engine is None else self._engine.costs

    @property
    def replans(self) -> int:
        return 0 if self._engine is None else self._engine.replans

    def observe(self, result: PipelineResult) -> bool:
        """Records one step; every `interval` calls re-plans (collective over the
        world: call it on every rank). Returns True when the schedule changed."""
        if self._engine is None:
            world = (dist.group.WORLD.group_name
                     if dist.is_initialized() and dist.get_world_size() > 1 else "")
            self._engine = _C.pipeline.AdaptiveSchedule(
                self.p, self.m, self.v, -1 if self.memory_limit is None else self.memory_limit,
                self.interval, pipeline_groups(resolve_state(self.state)), world)
        replans = self._engine.replans
        changed = self._engine.observe(
            {k: float(t) for k, t in result.compute_time.items()},
            list(result.tensor_shape) if result.tensor_shape is not None and self.p > 1 else [],
            result.dtype or torch.float32, result.device or torch.device("cpu"))
        if self._engine.replans != replans:
            self.schedule = Schedule(self._engine.schedule)
        return changed


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
