"""Activation recomputation, measured (`make bench-recompute`): activation
memory and step time of selective and full recomputation against none, in one
run, as ratios.

    python benchmarks/recompute.py [--iters 6] [--repeats 3]

Setting: the paper's (Korthikanti et al. 2022) regime on CPU — 2 Gloo ranks
(one thread each), TP2 with sequence parallelism, dropout 0.1 on the hidden
states and the attention probabilities (Megatron's defaults), sequence 512.
Default shape: hidden 256, 8 heads, micro-batch 2, 8 layers: 5as/h
(attention scores against the rest of a layer's activations) = 80, GPT-3
175B's, so the memory ratio is the paper's; but s/h = 2 (GPT-3: 0.17) makes
core attention, which selective recomputation runs twice, a far larger share
of the step than at scale. `--hidden-size 1024 --num-attention-heads 32
--micro-batch-size 1` keeps 5as/h = 80 at s/h = 0.5, nearer the regime the
paper's time overhead is about. fp32 (the ratios are per byte, the same in
bf16).

Activation memory: the pool's peak allocated bytes during one iteration's
forward and backward, minus what was allocated before it (weights,
gradients, optimizer state); rank 0. Step time: median over --iters timed
iterations (after one warm-up) of each mode, the modes run round-robin
--repeats times and the median of the repeats reported.

Core attention runs as Megatron's local backend (scores, softmax, dropout as
separate ops; dropout by our counter-based kernel, whose mask is regenerated
in backward rather than kept) and through torch's
scaled_dot_product_attention (``--attention-backend flash``; with dropout on
CPU, torch takes its math path and keeps the [s, s] probabilities and mask).
The peak includes the recomputation's own transient (one layer's attention
recomputed at a time), which the paper's stored-activation count leaves out.

Results: benchmarks/RESULTS.md ("Activation recomputation").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "python"))
from dist_harness import run_ranks  # noqa: E402  (spawns ranks, reports a dead one)

COMMON = ["--seq-length", "512", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
         "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--no-progress", "--no-watchdog", "--log-interval", "1000", "--lr-warmup-iters", "1"]
MODES = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full, uniform, 1 layer": ["--recompute-granularity", "full", "--recompute-method",
                               "uniform", "--recompute-num-layers", "1"],
    "full, block, 4 of 8 layers": ["--recompute-granularity", "full", "--recompute-method",
                                   "block", "--recompute-num-layers", "4"],
}
BACKENDS = {"local (fused kernels)": "local", "torch SDPA": "flash"}


def _rank(rank, world, iters, repeats, shape, backends):
    import megatronapp
    import torch
    from megatronapp import _C, memory
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step
    from megatronapp.training.step import _global_batch_loss

    torch.set_num_threads(1)  # one core per rank, as the peers' harness
    memory.use_pool("cpu")
    out = {}
    for _ in range(repeats):
        for backend in backends:
            name = BACKENDS[backend]
            for mode, flags in MODES.items():
                args = build_parser().parse_args(
                    COMMON + shape + flags + ["--attention-backend", name, "--train-iters",
                                     str(iters + 2), "--output-dir", "/tmp/mapp_recompute"])
                run = build_run(Config.from_args(args))
                train_step(run, 0)  # warm-up; the optimizer state exists after it
                run.optimizer.zero_grad(set_to_none=True)
                before = memory.stats()["allocated_bytes"]
                _C.memory_cpu_reset_peak_stats()
                _global_batch_loss(run, "train", 1, backward=True)
                act = memory.stats()["peak_allocated_bytes"] - before
                times = []
                for it in range(2, iters + 2):
                    t0 = time.perf_counter()
                    train_step(run, it)
                    times.append(time.perf_counter() - t0)
                row = out.setdefault((backend, mode), {"act": act, "step": []})
                row["step"].append(statistics.median(times))
                megatronapp.destroy_model_parallel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--local-only", action="store_true", help="skip the SDPA rows")
    a = ap.parse_args()
    shape = ["--hidden-size", str(a.hidden_size), "--num-attention-heads",
             str(a.num_attention_heads), "--num-layers", str(a.num_layers),
             "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size",
             str(a.micro_batch_size)]
    backends = list(BACKENDS)[:1] if a.local_only else list(BACKENDS)
    rows = run_ranks(_rank, 2, a.iters, a.repeats, shape, backends, timeout=7200)[0]
    h, heads = a.hidden_size, a.num_attention_heads
    print(f"hidden {h}, {heads} heads, seq 512, micro-batch {a.micro_batch_size}, "
          f"{a.num_layers} layers: 5as/h = {5 * heads * 512 / h:.0f}, s/h = {512 / h:.2f}\n")
    print("| core attention | recomputation | activation MiB | vs none | step s | vs none |")
    print("|---|---|---|---|---|---|")
    for backend in backends:
        base = rows[(backend, "none")]
        base_step = statistics.median(base["step"])
        for mode in MODES:
            r = rows[(backend, mode)]
            step = statistics.median(r["step"])
            print(f"| {backend} | {mode} | {r['act'] / 2**20:.1f} | {r['act'] / base['act']:.2f}x "
                  f"| {step:.3f} | {step / base_step:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
