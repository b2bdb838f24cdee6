"""The end of `make test`: where the suite's time went.

Reads the JUnit XML reports of ctest and pytest (build/test-reports/*.xml) and
prints the slowest tests, the time per file and the totals, so a test that
creeps up is seen by whoever lands the next change.

    python tests/durations.py [--top N] [REPORT.xml ...]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GLOB = os.path.join(ROOT, "build", "test-reports", "*.xml")
#: tests/python/dist_harness.py's cold starts of warm-rank pools (make test sets
#: MAPP_TEST_POOL_LOG to it): a cold pool of N ranks costs ~3 s per rank here
POOL_LOG = os.path.join(ROOT, "build", "test-reports", "pools.log")


def cases(path: str):
    """(suite file or ctest, test name, seconds, outcome) of every test case."""
    try:
        tree = ET.parse(path)
    except (ET.ParseError, OSError) as e:
        sys.exit(f"{path}: not a readable JUnit report ({e}); rerun the suite that writes it")
    for case in tree.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        if case.get("status") in ("notrun", "disabled"):  # ctest's own marks
            outcome = "skipped"
        name = case.get("name", "?")
        classname = case.get("classname", "")
        if classname.startswith("tests."):  # pytest: tests.python.test_x -> file
            where = classname.replace(".", "/") + ".py"
        else:
            where = "ctest"
        yield where, name, float(case.get("time", 0) or 0), outcome


def cold_starts(path: str) -> None:
    """How many warm-rank pools had to start cold, by world size and why."""
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.count("\t") == 2]
    by_world = collections.Counter(int(w) for w, _, _ in rows)
    ranks = sum(w * n for w, n in by_world.items())
    print(f"\n== {len(rows)} cold pool starts ({ranks} ranks spawned): "
          + ", ".join(f"{n} of {w}" for w, n in sorted(by_world.items())))
    reasons = collections.Counter(why.split(" after ")[0] if why.startswith("retired")
                                  else why for _, why, _ in rows)
    for why, n in reasons.most_common(8):
        print(f"{n:8d}  {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="*", help=f"JUnit XML files (default {DEFAULT_GLOB})")
    ap.add_argument("--top", type=int, default=25, help="how many of the slowest to list")
    args = ap.parse_args(argv)
    paths = args.reports or sorted(glob.glob(DEFAULT_GLOB))
    if not paths:
        sys.exit(f"no test reports under {DEFAULT_GLOB}: run `make test` first")
    rows = [c for p in paths for c in cases(p)]
    per_file = collections.defaultdict(float)
    counts = collections.Counter()
    for where, _, t, outcome in rows:
        per_file[where] += t
        counts[outcome] += 1
    print(f"\n== slowest {args.top} tests")
    for where, name, t, outcome in sorted(rows, key=lambda r: -r[2])[:args.top]:
        mark = "" if outcome == "passed" else f"  [{outcome}]"
        print(f"{t:8.1f} s  {where}::{name}{mark}")
    print("\n== time per file")
    for where, t in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"{t:8.1f} s  {where}")
    if os.path.exists(POOL_LOG):
        cold_starts(POOL_LOG)
    total = sum(per_file.values())
    print(f"\n{len(rows)} tests ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}), "
          f"{total:.0f} s of test time in {len(paths)} report(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
