"""CUDA-event timing and a one-rank NCCL world, shared by the GPU benchmark scripts."""

import os
import socket

import torch.distributed as dist

import torch


def single_rank_nccl() -> None:
    """A world of one NCCL rank on device 0 (the collectives' GPU paths with
    no peer), on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)


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
