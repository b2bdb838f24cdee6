"""Pipeline schedules as data (the C++ core) and their simulation.

    s = Schedule.one_f_one_b(p=4, m=8)
    s.actions(0)            # [F(mb=0, chunk=0), SEND_ACT(mb=0, chunk=0, peer=1), ...]
    r = simulate(s, forward=1.0, backward_input=1.0, backward_weight=1.0, p2p=0.05)
    r.makespan, r.bubble_fraction, r.peak_activations
    r.gantt("plan.png"); r.chrome_trace("plan.json")

Chunk c of stage s is virtual stage c * p + s (Megatron's interleaved layout,
placement ``loop``); ZB-V's ``wave`` placement runs odd chunks backwards
(c * p + p-1-s), so stage 0 holds the first and the last virtual stage and the
turn between chunks stays on one stage (``Schedule.vstage``).
Action types: F, B (full backward), BI (input gradient), W (deferred weight
gradient), SEND_ACT / RECV_ACT, SEND_GRAD / RECV_GRAD. See docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import _C

_pl = _C.pipeline
Action = _pl.Action

__all__ = ["Action", "Schedule", "SimulationResult", "simulate", "costs"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zb-v", "dynamic")


class Schedule:
    """An immutable, validated schedule: per stage, the ordered actions."""

    def __init__(self, cpp: _pl.Schedule):
        self._s = cpp

    @property
    def cpp(self) -> _pl.Schedule:
        """The C++ schedule object (``megatronapp._C.pipeline.Schedule``)."""
        return self._s

    # ---- constructors ----------------------------------------------------------
    @classmethod
    def gpipe(cls, p: int, m: int) -> Schedule:
        return cls(_pl.gpipe(p, m))

    @classmethod
    def one_f_one_b(cls, p: int, m: int) -> Schedule:
        return cls(_pl.one_f_one_b(p, m))

    @classmethod
    def interleaved(cls, p: int, m: int, v: int) -> Schedule:
        return cls(_pl.interleaved(p, m, v))

    @classmethod
    def zero_bubble(cls, p: int, m: int) -> Schedule:
        return cls(_pl.zero_bubble(p, m))

    @classmethod
    def zb_v(cls, p: int, m: int, costs: _pl.Costs | None = None) -> Schedule:
        """ZB-V (Qi et al., 2024): two chunks per stage in the V-shaped
        ``wave`` placement, backward split into BI and W, within 1F1B's
        activation memory; planned under `costs` (uniform by default)."""
        return cls(_pl.zb_v(p, m, costs))

    @classmethod
    def dynamic(cls, p: int, m: int, v: int = 1, policy: str = "auto",
                memory_limit: int | None = None, costs: _pl.Costs | None = None) -> Schedule:
        """The dynamic planner (``policy``: dfc, bfc, auto, adaptive). `costs`
        (see :func:`costs`) are the per-stage times it plans with; uniform by
        default. `memory_limit` caps live activations per stage, in units of one
        microbatch through one chunk."""
        return cls(_pl.dynamic(p, m, v, policy, memory_limit, costs))

    @classmethod
    def by_name(cls, name: str, p: int, m: int, v: int = 1, *, policy: str = "auto",
                memory_limit: int | None = None, costs: _pl.Costs | None = None) -> Schedule:
        """``gpipe``, ``1f1b``, ``interleaved``, ``zero-bubble``, ``zb-v`` (v = 2)
        or ``dynamic`` (the names of ``pretrain_gpt.py --pipeline-schedule``;
        ``1f1b`` with v > 1 is interleaved); `policy`, `memory_limit` and
        `costs` plan ``dynamic`` (`costs` also ``zb-v``)."""
        return cls(_pl.by_name(name, p, m, v, policy, memory_limit, costs))

    @classmethod
    def from_actions(cls, actions: Sequence[Sequence[tuple | Action]], microbatches: int,
                     chunks: int = 1, name: str = "custom", placement: str = "loop") -> Schedule:
        """A hand-written schedule: per stage a list of ``("F", mb, chunk)``
        tuples or Actions. Without any send/recv, transfers are inserted.
        `placement`: ``loop`` (Megatron's interleaved) or ``wave`` (ZB-V's V)."""
        rows = [[a if isinstance(a, Action) else Action(*a) for a in stage] for stage in actions]
        return cls(_pl.Schedule(name, len(rows), microbatches, chunks, rows, placement))

    @classmethod
    def from_csv(cls, text_or_path: str | Path) -> Schedule:
        return cls(_pl.from_csv(_read(text_or_path)))

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Schedule:
        return cls(_pl.from_json(_read(text_or_path)))

    # ---- accessors ---------------------------------------------------------------
    name = property(lambda self: self._s.name)
    stages = property(lambda self: self._s.stages)
    microbatches = property(lambda self: self._s.microbatches)
    chunks = property(lambda self: self._s.chunks)
    placement = property(lambda self: self._s.placement)  #: "loop" or "wave"

    def vstage(self, stage: int, chunk: int) -> int:
        """The virtual stage (position in the model) of `chunk` on `stage`."""
        return self._s.vstage(stage, chunk)

    def stage_of(self, vstage: int) -> int:
        """The stage that holds virtual stage `vstage`."""
        return self._s.stage_of(vstage)

    def actions(self, stage: int) -> list[Action]:
        return self._s.actions(stage)

    def peak_activations(self, stage: int | None = None):
        """Peak live activations of `stage` (all stages as a list if None)."""
        if stage is None:
            return [self._s.peak_activations(s) for s in range(self.stages)]
        return self._s.peak_activations(stage)

    def validate(self) -> str:
        """'' when valid, else the first violation."""
        return self._s.validate()

    def to_csv(self) -> str:
        return self._s.to_csv()

    def to_json(self) -> str:
        return self._s.to_json()

    def __repr__(self) -> str:
        wave = ", placement='wave'" if self.placement == "wave" else ""
        return (f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"chunks={self.chunks}{wave})")


def _read(text_or_path) -> str:
    if isinstance(text_or_path, Path) or (
            isinstance(text_or_path, str) and "\n" not in text_or_path
            and Path(text_or_path).is_file()):
        return Path(text_or_path).read_text()
    return text_or_path


def per_stage(x, p: int, name: str) -> list[float]:
    """`x` as one float per stage: a number repeated, or a list of exactly `p`."""
    if isinstance(x, (int, float)):
        return [float(x)] * p
    vals = [float(v) for v in x]
    if len(vals) != p:
        raise ValueError(f"{name}: expected a number or {p} per-stage values, got {len(vals)}")
    return vals


def costs(p: int, forward=1.0, backward_input=1.0, backward_weight=1.0, p2p=0.0) -> _pl.Costs:
    """Per-stage time model: each argument a number or one value per stage
    (p2p: per link s <-> s+1). A full backward costs backward_input +
    backward_weight."""
    return _pl.Costs(per_stage(forward, p, "forward"),
                     per_stage(backward_input, p, "backward_input"),
                     per_stage(backward_weight, p, "backward_weight"),
                     per_stage(p2p, p, "p2p"))


@dataclass
class SimulationResult:
    schedule: Schedule
    makespan: float
    bubble_fraction: float
    peak_activations: list
    busy: list
    timeline: list = field(repr=False)  # (stage, Action, start, end)
    _cpp: object = field(repr=False, default=None)

    def chrome_trace(self, path: str | Path | None = None) -> str:
        """Chrome Trace Event JSON (Perfetto); written to `path` if given."""
        text = _pl.chrome_trace(self.schedule.cpp, self._cpp)
        if path is not None:
            Path(path).write_text(text)
        return text

    def gantt(self, path: str | Path, title: str | None = None) -> None:
        """Draws the plan (one row per stage, transfers as thin bars) to a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"F": "#4c72b0", "B": "#dd8452", "BI": "#c44e52", "W": "#55a868"}
        p = self.schedule.stages
        fig, ax = plt.subplots(figsize=(max(8, min(24, len(self.timeline) / 12)), 0.6 * p + 1.2))
        for stage, a, start, end in self.timeline:
            if a.is_compute:
                ax.barh(stage, end - start, left=start, height=0.8, color=colors[a.type],
                        edgecolor="black", linewidth=0.4)
                label = f"{a.microbatch}" + (f".{a.chunk}" if self.schedule.chunks > 1 else "")
                ax.text((start + end) / 2, stage, label, ha="center", va="center", fontsize=6,
                        color="white")
            else:
                off = 0.45 if a.type == "SEND_ACT" else -0.45
                ax.barh(stage + off, end - start, left=start, height=0.08, color="gray")
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(handles, list(colors), loc="upper right", fontsize=7, ncols=4)
        ax.set_title(title or f"{self.schedule.name}: makespan {self.makespan:.3g}, "
                     f"bubble {self.bubble_fraction:.1%}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def simulate(schedule: Schedule, forward=1.0, backward_input=1.0, backward_weight=1.0,
             p2p=0.0, *, bandwidth=None, message_bytes: float = 0.0) -> SimulationResult:
    """Event-driven simulation of `schedule` (executor semantics: sends and
    receives never block, a compute action waits for its input; each direction
    of a link carries one message at a time). Times are numbers or per-stage
    lists; a full backward costs backward_input + backward_weight. `p2p` is the
    per-message latency of each link s <-> s+1; with `bandwidth` (bytes/s, a
    number or per link) a message also takes message_bytes / bandwidth."""
    p = schedule.stages
    link = per_stage(p2p, p, "p2p")
    if bandwidth is not None:
        bw = per_stage(bandwidth, p, "bandwidth")
        if any(b <= 0 for b in bw):
            raise ValueError(f"bandwidth must be positive, got {bandwidth}")
        link = [t + message_bytes / b for t, b in zip(link, bw, strict=True)]
    c = costs(p, forward, backward_input, backward_weight, link)
    r = _pl.simulate(schedule.cpp, c)
    return SimulationResult(schedule, r.makespan, r.bubble_fraction, list(r.peak_activations),
                            list(r.busy), r.timeline, r)
