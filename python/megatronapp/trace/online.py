"""Online slow-rank detection during training (``--trace-detect-interval N``).

Every N traced iterations all ranks flush their traces and meet at a barrier;
rank 0 reads the files of the last N traced iterations (a shared directory),
runs the detector and logs a warning naming the suspect (with its confidence),
or "not enough evidence". The first window judged healthy becomes each rank's
history: later windows also compare every rank with its own earlier op times,
which catches a device that slows down mid-run even where no peer does the
same work (PP4)."""

from __future__ import annotations

import torch.distributed as dist

from .. import _C
from . import flush
from .detect import DEFAULT_ALPHA, DEFAULT_THRESHOLD, baseline, detect_dir

__all__ = ["OnlineDetector"]


class OnlineDetector:
    def __init__(self, directory: str, interval: int, world: int,
                 threshold: float = DEFAULT_THRESHOLD, alpha: float = DEFAULT_ALPHA):
        self.directory, self.interval, self.world = directory, interval, world
        self.threshold, self.alpha = threshold, alpha
        self.window: list = []
        self.reports: list = []
        self.history: dict | None = None

    def after_traced_iteration(self, it: int) -> None:
        self.window.append(it)
        if len(self.window) < self.interval:
            return
        flush()
        if dist.is_initialized():
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            report = detect_dir(self.directory, self.threshold, iterations=self.window,
                                alpha=self.alpha, history=self.history, return_events=True)
            events = report.pop("_events")
            if self.history is None and report["verdict"] != "slow":
                self.history = baseline(events)
            entry = {"iterations": list(self.window), "verdict": report["verdict"],
                     "suspects": [{k: s[k] for k in ("rank", "score", "cause", "confidence")}
                                  for s in report["suspects"]]}
            self.reports.append(entry)
            for s in entry["suspects"][:1]:
                _C.log("warning", f"slow rank suspected: rank {s['rank']} ({s['cause']}, "
                       f"{100 * s['score']:+.0f}%, confidence {s['confidence']:.4f}) over "
                       f"iterations {self.window[0]}-{self.window[-1]}")
        self.window = []
