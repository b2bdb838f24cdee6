"""Memory-pool benchmarks, side by side in one run (make bench-memory).

1. Cache-hit alloc+free latency: ours (with the CPU pool's thread cache, and
   locked) vs glibc malloc vs torch's default CPU allocator, one thread and two
   at once (the C++ program build/py/benchmarks/pool_latency).
2. Allocation traces recorded from real GPT training runs on 4 CPU ranks
   (with --memory-pool --record-alloc-trace), replayed through
   PyTorch's caching-allocator policy ("torch-like", reproduced on our
   machinery), our policy on plain segments, and ours with expandable
   segments — without a thread cache (as device pools run) and with the CPU
   pool's 1 MiB one ("ours+tc"): peak reserved, utilization = peak allocated /
   peak reserved, and time per operation.

    python benchmarks/memory_pool.py [--skip-record]

Traces of rank 0 (and of the last stage, rank 3, for pipeline runs) are kept
in benchmarks/traces/ (the GPU script replays them).
"""

import argparse
import os
import subprocess
import sys

import megatronapp as mapp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "benchmarks", "traces")
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "256", "--micro-batch-size", "8", "--global-batch-size", "32",
         "--train-iters", "6", "--eval-iters", "1", "--no-progress"]
CONFIGS = {
    "gpt_tp2_dp2": ["--tensor-model-parallel-size", "2"],
    "gpt_tp2_dp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "gpt_tp4": ["--tensor-model-parallel-size", "4"],
    "gpt_dp4": ["--tensor-model-parallel-size", "1"],
    "gpt_tp2_dp2_zero1": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    "gpt_dp4_zero1_int8": ["--tensor-model-parallel-size", "1", "--use-distributed-optimizer",
                           "--grad-compression", "int8"],
    "gpt_tp2_pp2_zb": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--pipeline-schedule", "zero-bubble"],
    "gpt_pp2_dp2_zero1_dyn": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                              "dynamic", "--use-distributed-optimizer"],
    "gpt_pp2_vpp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--virtual-pipeline-model-parallel-size", "2"],
}
# Pipeline runs: the first stage (rank 0) and the last (rank 3: loss and logits).
KEEP = {name: (0, 3) if "pp" in name else (0,) for name in CONFIGS}


def record(name, flags, port):
    out = os.path.join(TRACES, f"{name}.rank{{rank}}.trace")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           os.path.join(ROOT, "examples", "pretrain_gpt.py"), *MODEL, *flags,
           "--memory-pool", "--record-alloc-trace", out, "--output-dir",
           os.path.join(ROOT, "runs", "traces", name)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for r in (0, 1, 2, 3):
        if r not in KEEP[name]:
            os.remove(out.replace("{rank}", str(r)))
    return [out.replace("{rank}", str(r)) for r in KEEP[name]]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--skip-record", action="store_true", help="replay the existing traces")
    args = p.parse_args()
    latency = os.path.join(ROOT, "build", "py", "benchmarks", "pool_latency")
    if os.path.exists(latency):
        subprocess.run([latency], check=True)
    else:
        print(f"({latency} not built: run `make build` first for the latency table)")
    os.makedirs(TRACES, exist_ok=True)
    traces = []
    for i, (name, flags) in enumerate(CONFIGS.items()):
        paths = [os.path.join(TRACES, f"{name}.rank{r}.trace") for r in KEEP[name]]
        if not args.skip_record or not all(os.path.exists(p) for p in paths):
            print(f"recording {name} ...", flush=True)
            paths = record(name, flags, 29540 + i)
        for r, path in zip(KEEP[name], paths, strict=True):
            traces.append((name if r == 0 else f"{name}.r{r}", path))
    rows = []
    for name, path in traces:
        res = {label: mapp.memory.replay(path, pol, expandable_segments=exp, thread_cache_bytes=t)
               for label, pol, exp, t in (("torch-like", "torch-like", False, 0),
                                          ("ours-plain", "ours", False, 0), ("ours", "ours", True, 0),
                                          ("ours+tc", "ours", True, None))}
        rows.append((name, res))
    print("\nreplay of GPT allocation traces (rank 0; .r3 = last pipeline stage), same requests "
          "through each policy")
    print(f"{'trace':<24} {'ops':>7} {'peak alloc':>11} | {'reserved: torch-like':>21} "
          f"{'ours-plain':>11} {'ours':>9} {'ours+tc':>9} | {'util: torch-like':>17} "
          f"{'ours-plain':>11} {'ours':>7} {'ours+tc':>8} | {'ns/op torch-like':>16} {'ours':>6} "
          f"{'ours+tc':>8}")
    mib = 2 ** 20
    for name, res in rows:
        t, o, e, c = res["torch-like"], res["ours-plain"], res["ours"], res["ours+tc"]
        print(f"{name:<24} {t['operations']:>7} {t['peak_allocated_bytes'] / mib:>9.1f}Mi | "
              f"{t['peak_reserved_bytes'] / mib:>19.1f}Mi {o['peak_reserved_bytes'] / mib:>9.1f}Mi "
              f"{e['peak_reserved_bytes'] / mib:>7.1f}Mi {c['peak_reserved_bytes'] / mib:>7.1f}Mi | "
              f"{100 * t['utilization']:>16.1f}% {100 * o['utilization']:>10.1f}% "
              f"{100 * e['utilization']:>6.1f}% {100 * c['utilization']:>7.1f}% | "
              f"{t['ns_per_op']:>16.0f} {e['ns_per_op']:>6.0f} {c['ns_per_op']:>8.0f}")


if __name__ == "__main__":
    main()
