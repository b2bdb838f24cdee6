"""bf16 mixed-precision training on one GPU through the training edge
(`make gpu-check` runs it): MFU by Megatron's FLOPs formula and the CUDA
pool's measured peak against the memory planner's estimate.

    python benchmarks/e2e/precision_gpu.py [--num-layers 24 --hidden-size 2048 ...]

One process, NCCL with world size 1: ``build_run`` + ``train_step`` exactly as
pretrain_gpt.py runs them, with --bf16 (fp32 main gradients and master
weights in the optimizer), --use-distributed-optimizer and the CUDA memory
pool (installed before the first CUDA allocation). Then, with
``--recompute-granularity selective`` and ``full``, the same. A 2-rank NCCL run
needs two GPUs (NCCL cannot put two ranks on one device): with fewer it is
skipped with a message.

MFU = 72 B s L h^2 (1 + s/6h + V/12Lh) / step time / peak (no recomputation
counted: Korthikanti et al.'s model FLOPs), peak = --peak-tflops (989 for
H100/H200 SXM dense bf16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-layers", type=int, default=24)
    ap.add_argument("--hidden-size", type=int, default=2048)
    ap.add_argument("--num-attention-heads", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("precision_gpu: no CUDA device; skipped")
        return 0
    from megatronapp import memory

    memory.use_pool("cuda")  # before anything touches CUDA memory
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import megatronapp
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step

    L, h, s, b = a.num_layers, a.hidden_size, a.seq_length, a.micro_batch_size
    vocab = 256  # the byte-level tokenizer of the bundled corpus, padded to 256
    flops = 72.0 * b * s * L * h * h * (1 + s / (6 * h) + vocab / (12 * L * h))
    rows = []
    for mode in ([], ["--recompute-granularity", "selective"],
                 ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]):
        flags = ["--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads",
                 str(a.num_attention_heads), "--seq-length", str(s), "--micro-batch-size",
                 str(b), "--global-batch-size", str(b), "--bf16", "--use-distributed-optimizer",
                 "--distributed-backend", "nccl", "--no-progress", "--no-watchdog",
                 "--train-iters", str(a.steps + 2), "--output-dir", "/tmp/mapp_precision_gpu",
                 *mode]
        cfg = Config.from_args(build_parser().parse_args(flags))
        run = build_run(cfg)
        memory.reset_peak_stats("cuda")
        times = []
        for it in range(a.steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(run, it)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step = statistics.median(times[2:])
        peak = memory.stats("cuda")["peak_allocated_bytes"]
        est = memory.estimate(run.config, 1)
        rows.append((" ".join(mode) or "none", step, flops / step / (a.peak_tflops * 1e12),
                     peak, est.total))
        megatronapp.destroy_model_parallel()
        del run
        memory.release_cached("cuda")
    print(f"\nGPT {L} layers, hidden {h}, seq {s}, micro-batch {b}, bf16 + ZeRO-1 (dp 1), "
          f"one GPU\n")
    print("| recomputation | step s | MFU | peak allocated GiB | planner GiB | planner / peak |")
    print("|---|---|---|---|---|---|")
    for mode, step, mfu, peak, est in rows:
        print(f"| {mode} | {step:.3f} | {100 * mfu:.1f}% | {peak / 2**30:.2f} | "
              f"{est / 2**30:.2f} | {est / peak:.3f} |")
    if torch.cuda.device_count() < 2:
        print("\n2-rank NCCL run skipped: NCCL needs one GPU per rank and this machine has "
              f"{torch.cuda.device_count()}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
