"""The memory planner against the measured peak (`make bench-memory-plan`):
for every layout of tests/python/test_memory_plan.py's matrix, on 4 Gloo
ranks with the pool, each pipeline stage's planned total (the planner's peak
allocated bytes) next to the pool's measured peak allocated bytes over three
training steps, and their ratio.

    python benchmarks/memory_plan.py

Results: benchmarks/RESULTS.md ("Memory planner").
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "python"))
from test_memory_plan import MATRIX, MODEL, _measure  # noqa: E402  (one matrix, one method)

from dist_harness import run_ranks  # noqa: E402


def main() -> None:
    from megatronapp.data import default_corpus

    tmp = tempfile.mkdtemp(prefix="mapp_plan_")
    corpus = os.path.join(tmp, "corpus.txt")
    with open(default_corpus(), encoding="utf-8") as f, open(corpus, "w", encoding="utf-8") as g:
        g.write(f.read()[:65536])
    print("| layout | stage | planned MiB | measured MiB | planned / measured | "
          "of which activations (planned) |")
    print("|---|---|---|---|---|---|")
    only = sys.argv[1:]  # layout names: just those rows
    for name, flags in MATRIX.items():
        if only and name not in only:
            continue
        ranks = run_ranks(_measure, 4, MODEL + flags + ["--data-path", corpus, "--output-dir", tmp],
                          timeout=600)
        seen = set()
        for measured, est in ranks:
            if est["stage"] in seen:
                continue
            seen.add(est["stage"])
            acts = est["in_flight_activations"] + est["transient"]
            print(f"| {name} | {est['stage']} | {est['total'] / 2**20:.2f} | "
                  f"{measured / 2**20:.2f} | {est['total'] / measured:.3f} | "
                  f"{acts / 2**20:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
