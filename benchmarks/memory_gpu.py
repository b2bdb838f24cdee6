"""GPU memory pool vs PyTorch's CUDACachingAllocator on the same traces.

    python benchmarks/memory_gpu.py [TRACE ...]     (default: benchmarks/traces/*.trace)

Each allocator runs in its own fresh process (an allocator cannot be swapped
once CUDA memory exists): "torch" uses the default caching allocator, "ours"
calls megatronapp.memory.use_pool("cuda") first. Both replay every trace twice
through the same Python loop (torch.empty / del, uint8), so per-operation time
includes the same interpreter overhead. Reported: peak reserved bytes, device
allocations (cudaMalloc / cuMemMap) during the second, steady-state pass, and
p50 time per operation. The table is printed last.
"""

import glob
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def replay_in_process(mode, traces):
    import megatronapp as mapp
    import torch

    if mode == "ours":
        mapp.memory.use_pool("cuda")
    torch.cuda.init()
    out = {}
    for path in traces:
        events = mapp._C.memory_load_trace(path)
        times, device_allocs = [], []
        for _ in range(2):
            if mode == "torch":
                before = torch.cuda.memory_stats().get("segment.all.allocated", 0)
            else:
                before = (mapp.memory.stats("cuda")["num_device_allocs"]
                          if mapp.memory.is_installed("cuda") else 0)
            live = {}
            for op, ident, size, _stream in events:
                t0 = time.perf_counter_ns()
                if op == 1:
                    live[ident] = torch.empty(size, dtype=torch.uint8, device="cuda")
                elif op == 2:
                    del live[ident]
                elif op == 4:
                    if mode == "torch":
                        torch.cuda.empty_cache()
                    else:
                        mapp.memory.release_cached("cuda")
                times.append(time.perf_counter_ns() - t0)
            live.clear()
            torch.cuda.synchronize()
            if mode == "torch":
                after = torch.cuda.memory_stats().get("segment.all.allocated", 0)
            else:
                after = mapp.memory.stats("cuda")["num_device_allocs"]
            device_allocs.append(after - before)
        if mode == "torch":
            peak = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
        else:
            peak = mapp.memory.stats("cuda")["peak_reserved_bytes"]
            mapp.memory.release_cached("cuda")
            mapp._C.memory_cuda_reset_peak(torch.cuda.current_device())
        out[os.path.basename(path)] = {"peak_reserved": peak,
                                       "steady_device_allocs": device_allocs[1],
                                       "p50_ns": statistics.median(times)}
    return out


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        mode, traces = sys.argv[2], sys.argv[3:]
        print("RESULT " + json.dumps(replay_in_process(mode, traces)))
        return
    traces = sys.argv[1:] or sorted(glob.glob(os.path.join(ROOT, "benchmarks", "traces", "*.trace")))
    results = {}
    for mode in ("torch", "ours"):
        proc = subprocess.run([sys.executable, __file__, "--child", mode, *traces],
                              capture_output=True, text=True, check=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        results[mode] = json.loads(line[len("RESULT "):])
    mib = 2 ** 20
    print(f"\n{'trace':<28} {'reserved torch':>15} {'ours':>9} {'ours/torch':>11} "
          f"{'steady mallocs torch':>21} {'ours':>5} {'p50 ns torch':>13} {'ours':>6}")
    for name in results["torch"]:
        t, o = results["torch"][name], results["ours"][name]
        print(f"{name:<28} {t['peak_reserved'] / mib:>13.1f}Mi {o['peak_reserved'] / mib:>7.1f}Mi "
              f"{o['peak_reserved'] / max(t['peak_reserved'], 1):>10.2f}x "
              f"{t['steady_device_allocs']:>21} {o['steady_device_allocs']:>5} "
              f"{t['p50_ns']:>13.0f} {o['p50_ns']:>6.0f}")


if __name__ == "__main__":
    main()
