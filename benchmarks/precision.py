"""Mixed precision, measured (`make bench-precision`): bf16 against fp32 on the
demo model, and bytes per parameter per rank against Megatron's formula.

    python benchmarks/precision.py [--iters 200]

1. Quality: the demo GPT (4 layers, hidden 128, seq 64, global batch 16) for
   --iters steps in fp32 and in bf16 (fp32 main gradients and masters), on 4
   Gloo ranks, for TP2 x DP2 with ZeRO-1 and int8 compression and for
   TP2 x PP2 zero-bubble: final validation losses and their relative gap
   (goal: within 2%); and FP8 (hybrid, delayed scaling, emulated:
   megatronapp.fp8) with bf16 parameters against bf16.
2. Memory: per rank, the bytes the run holds per model parameter it hosts —
   parameters, gradient buffers (fp32 main gradients under bf16), fp32 master
   weights, optimizer moments — counted from the live tensors of a built run
   for fp32, bf16 and bf16 + ZeRO-1 at dp = 4, next to Megatron's 18 bytes per
   parameter (bf16 + fp32 main grads + fp32 master + Adam) and the ZeRO
   paper's 2 + 4 + 12/N form for the sharded part.

Results: benchmarks/RESULTS.md ("Mixed precision").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "python"))
from dist_harness import run_ranks  # noqa: E402  (spawns ranks, reports a dead one)

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "20", "--eval-iters", "8",
         "--no-progress", "--log-interval", "1000", "--no-watchdog"]
LAYOUTS = {
    "TP2 x DP2, ZeRO-1, int8": ["--tensor-model-parallel-size", "2",
                                "--use-distributed-optimizer", "--grad-compression", "int8"],
    "TP2 x PP2, zero-bubble": ["--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2",
                               "--pipeline-schedule", "zero-bubble"],
}


def _rank(rank, world, what, flags):
    """One rank (process group already up: tests/python/dist_harness.run_ranks)."""
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train, train_step

    args = build_parser().parse_args(MODEL + flags + ["--output-dir", "/tmp/mapp_precision"])
    if what == "train":
        return train(args)["valid_loss"]
    run = build_run(Config.from_args(args))
    train_step(run, 0)  # the optimizer's state exists after its first step
    return _bytes(run)


def _bytes(run) -> dict:
    """Bytes per hosted parameter on this rank, by kind."""
    params = [p for c in run.chunks for p in c.parameters()]
    n = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                for c in run.chunks for b in c.buckets)
    opt = run.optimizer
    master = getattr(opt, "main_param_bytes", lambda: 0)()
    inner = getattr(opt, "optimizer", opt)  # the torch optimizer holding the moments
    moments = sum(t.numel() * t.element_size() for st in inner.state.values()
                  for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"params": n, "weights": weights / n, "grads": grads / n, "master": master / n,
            "moments": moments / n}


def launch(what, flags, world=4):
    return run_ranks(_rank, world, what, flags, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    print(f"### Quality: {a.iters} steps, final validation loss (mean of 8 batches)\n")
    print("| layout | fp32 | bf16 | bf16 / fp32 - 1 | FP8 hybrid (bf16 params) | "
          "FP8 / bf16 - 1 |")
    print("|---|---|---|---|---|---|")
    for name, flags in LAYOUTS.items():
        steps = ["--train-iters", str(a.iters)]
        f32 = launch("train", flags + steps)[0]
        b16 = launch("train", flags + steps + ["--bf16"])[0]
        f8 = launch("train", flags + steps + ["--bf16", "--fp8-format", "hybrid"])[0]
        print(f"| {name} | {f32:.4f} | {b16:.4f} | {b16 / f32 - 1:+.2%} | {f8:.4f} | "
              f"{f8 / b16 - 1:+.2%} |", flush=True)
    print("\n### Bytes per parameter per rank (rank 0, TP1 x DP4; AdamW)\n")
    print("| precision | weights | gradients | fp32 master | moments | total | "
          "Megatron / ZeRO formula |")
    print("|---|---|---|---|---|---|---|")
    dp4 = ["--tensor-model-parallel-size", "1"]
    for name, flags, formula in (
            ("fp32", [], "4 + 4 + 8 = 16"),
            ("bf16", ["--bf16"], "2 + 4 + 4 + 8 = 18"),
            ("bf16 + ZeRO-1, dp=4", ["--bf16", "--use-distributed-optimizer"],
             "2 + 4 + 12/4 = 9")):
        r = launch("bytes", dp4 + flags + ["--train-iters", "1"])[0]
        total = r["weights"] + r["grads"] + r["master"] + r["moments"]
        print(f"| {name} | {r['weights']:.2f} | {r['grads']:.2f} | {r['master']:.2f} | "
              f"{r['moments']:.2f} | {total:.2f} | {formula} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
