"""Online slow-rank detection during training (``--trace-detect-interval N``).

Every N traced iterations all ranks flush their traces and meet at a barrier;
rank 0 reads the files of the last N traced iterations (a shared directory),
runs the detector and logs a warning naming the suspect."""

from __future__ import annotations

import torch.distributed as dist

from .. import _C
from . import flush
from .detect import DEFAULT_THRESHOLD, detect_dir

__all__ = ["OnlineDetector"]


class OnlineDetector:
    def __init__(self, directory: str, interval: int, world: int,
                 threshold: float = DEFAULT_THRESHOLD):
        self.directory, self.interval, self.world = directory, interval, world
        self.threshold = threshold
        self.window: list = []
        self.reports: list = []

    def after_traced_iteration(self, it: int) -> None:
        self.window.append(it)
        if len(self.window) < self.interval:
            return
        flush()
        if dist.is_initialized():
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            report = detect_dir(self.directory, self.threshold, iterations=self.window)
            entry = {"iterations": list(self.window),
                     "suspects": [{k: s[k] for k in ("rank", "score", "cause")}
                                  for s in report["suspects"]]}
            self.reports.append(entry)
            for s in entry["suspects"][:1]:
                _C.log("warning", f"slow rank suspected: rank {s['rank']} (score "
                       f"{s['score']:.2f}, {s['cause']}) over iterations "
                       f"{self.window[0]}-{self.window[-1]}")
        self.window = []
