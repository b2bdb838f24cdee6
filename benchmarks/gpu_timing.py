"""CUDA-event timing shared by the GPU benchmark scripts."""

import torch


def timed_ms(fn, iters=50, warmup=10):
    """Mean milliseconds per call of `fn`, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
