"""``python -m megatronapp.trace aggregate DIR -o merged.json [--detect]``
``python -m megatronapp.trace phases DIR``: where each rank's step goes."""

from __future__ import annotations

import argparse
import json
import sys

from .aggregate import merge
from .detect import DEFAULT_ALPHA, DEFAULT_THRESHOLD, detect, format_report
from .phases import breakdown_dir, format_breakdown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="megatronapp-trace", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ag = sub.add_parser("aggregate", help="merge per-rank traces (and detect slow ranks)")
    ag.add_argument("directory")
    ag.add_argument("-o", "--output", default="merged.json")
    ag.add_argument("--detect", action="store_true")
    ag.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                    help="smallest slowdown against peers worth naming (relative; "
                         f"default {DEFAULT_THRESHOLD})")
    ag.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                    help="error probability allowed for naming a rank that is not slow "
                         f"(default {DEFAULT_ALPHA})")
    ag.add_argument("--report", default=None, help="write the detection report as JSON")
    ph = sub.add_parser("phases", help="median time per phase of the traced iterations, "
                                       "per rank (compute, TP collectives, P2P wait, ...)")
    ph.add_argument("directory")
    ph.add_argument("--skip", type=int, default=0, help="leave out the first N traced "
                                                        "iterations of each rank (warm-up)")
    ph.add_argument("--json", default=None, help="also write the breakdown as JSON")
    args = ap.parse_args(argv)
    if args.cmd == "phases":
        try:
            result = breakdown_dir(args.directory, args.skip)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_breakdown(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    try:
        summary = merge(args.directory, args.output)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged {len(summary['ranks'])} ranks, {summary['events']} events, "
          f"{summary['flows']} P2P flows -> {args.output}; clocks aligned on "
          f"{summary['instances']} collectives (residual {summary['residual_us']:.1f} us)")
    if args.detect:
        report = detect(summary["aligned"], summary["meta"], args.threshold,
                        alpha=args.alpha)
        report["alignment_residual_us"] = summary["residual_us"]
        print(format_report(report))
        if args.report:
            with open(args.report, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
