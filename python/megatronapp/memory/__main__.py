"""``python -m megatronapp.memory`` (also ``megatronapp-memory``):

    python -m megatronapp.memory estimate <pretrain flags> [--world-size N] [--json]
    python -m megatronapp.memory replay TRACE...

``estimate`` prints the planner's per-rank breakdown of a run (every pipeline
stage); ``replay`` compares pool policies on recorded allocation traces."""

from __future__ import annotations

import argparse
import json
import os

from . import estimate, replay
from .plan import MemoryLimitError


def _estimate_main(argv) -> None:
    from ..training import Config, ConfigError, build_parser
    from ..training.setup import resolve_auto_recompute

    p = argparse.ArgumentParser(
        prog="python -m megatronapp.memory estimate",
        description="Per-rank memory of a pretrain_gpt.py run, before running it: give the "
                    "run's flags (and --world-size).")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks of the run (default tp x pp)")
    p.add_argument("--stage", type=int, default=None, help="one pipeline stage (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    own, rest = p.parse_known_args(argv)
    cfg = Config.from_args(build_parser().parse_args(rest))
    par = cfg.parallel
    world = own.world_size or par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    try:
        plan = cfg.check(world)
        resolve_auto_recompute(cfg, world)
        stages = range(plan.pp) if own.stage is None else [own.stage]
        results = [estimate(cfg.flat(), world, stage=s) for s in stages]
    except (ConfigError, MemoryLimitError) as e:
        raise SystemExit(f"error: {e}") from None
    if own.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
        return
    print(f"world size {world}; per rank:")
    for r in results:
        print(r.table())
    limit = cfg.memory.memory_limit_gb
    worst = max(results, key=lambda r: r.total)
    if limit is not None:
        fits = "fits" if worst.total <= limit * 2**30 else "does NOT fit"
        print(f"worst stage {worst.stage}: {worst.total / 2**30:.3f} GiB {fits} in "
              f"--memory-limit-gb {limit}")


def main(argv=None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["estimate"]:
        _estimate_main(argv[1:])
        return
    p = argparse.ArgumentParser(prog="megatronapp-memory",
                                description="Replay allocation traces through pool policies; "
                                            "'estimate <pretrain flags>' plans a run's memory.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay", help="compare policies on recorded traces")
    r.add_argument("traces", nargs="+")
    sub.add_parser("estimate", help="per-rank memory of a run: estimate <pretrain flags> "
                                    "[--world-size N]")
    args = p.parse_args(argv)
    policies = [("torch-like", True), ("ours", False), ("ours", True)]
    print(f"{'trace':<28} {'policy':<12} {'ops':>9} {'peak alloc MiB':>15} "
          f"{'peak reserved MiB':>18} {'utilization':>12} {'ns/op':>7}")
    for path in args.traces:
        for policy, exp in policies:
            res = replay(path, policy, expandable_segments=exp)
            print(f"{os.path.basename(path):<28} {res['policy']:<12} {res['operations']:>9} "
                  f"{res['peak_allocated_bytes'] / 2**20:>15.1f} "
                  f"{res['peak_reserved_bytes'] / 2**20:>18.1f} "
                  f"{100 * res['utilization']:>11.1f}% {res['ns_per_op']:>7.0f}")




if __name__ == "__main__":
    main()
