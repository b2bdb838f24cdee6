"""Pipeline parallelism: schedules as data, a simulator, and an executor.

* :class:`Schedule` — GPipe, 1F1B, interleaved 1F1B, ZB-H1 zero-bubble and the
  dynamic planner (dfc / bfc / auto / adaptive), validated, importable and
  exportable as CSV or JSON (the C++ core, ``src/pipeline``).
* :func:`simulate` — makespan, bubble fraction and peak activations of a
  schedule under per-stage times; Gantt PNG and Chrome trace.
* :func:`forward_backward` — runs this rank's actions with asynchronous P2P.
* :class:`AdaptiveSchedule` — re-plans from measured times every few steps.

See docs/pipeline.md.
"""

from . import fbd
from .adaptive import AdaptiveSchedule, current_schedule, make_schedule
from .executor import GradSync, PipelineResult, forward_backward, to_device
from .schedules import SCHEDULES, Action, Schedule, SimulationResult, costs, simulate

__all__ = ["Action", "fbd", "AdaptiveSchedule", "GradSync", "PipelineResult", "SCHEDULES", "Schedule",
           "SimulationResult", "costs", "current_schedule", "forward_backward", "make_schedule",
           "simulate", "to_device"]
