"""Tensor-parallel MLP block: MegatronApp vs PyTorch DTensor, side by side.

    torchrun --nproc-per-node 2 benchmarks/tp_mlp_vs_dtensor.py [--iters 30]

Same shapes, same weights, same input, in one run on the same ranks: an MLP
(h -> 4h -> GELU -> h) split column-then-row across the tensor group, timed
forward + backward. Ours: ColumnParallelLinear + RowParallelLinear (C++
collectives over c10d). Baseline: nn.Sequential parallelized with
torch.distributed.tensor.parallel.parallelize_module(ColwiseParallel,
RowwiseParallel). Prints the median step time of each and the ratio
(baseline / ours: > 1 means ours is faster) after checking both compute the
same output.
"""

import argparse
import statistics
import time

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import megatronapp as mapp
import torch
from megatronapp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn


class OurMLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1 = ColumnParallelLinear(h, 4 * h)
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(4 * h, h)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def median_ms(fn, iters, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    # The slowest rank defines the step: take the max of the medians.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mapp.initialize_model_parallel(tensor_model_parallel_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for s, b, h in [(128, 4, 256), (256, 4, 512), (256, 8, 1024)]:
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        full = {k.replace("0.", "fc1.").replace("2.", "fc2."): v for k, v in ref.state_dict().items()}
        ours = OurMLP(h)
        mapp.tensor_parallel.load_full_state_dict(ours, full)
        theirs = parallelize_module(ref, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(s, b, h)
        with torch.no_grad():
            err = (ours(x) - theirs(x)).abs().max().item()
        assert err < 1e-4, f"outputs differ by {err}"

        def step(model):
            def run():
                xi = x.clone().requires_grad_()
                model(xi).sum().backward()
            return run

        ours_ms = median_ms(step(ours), args.iters)
        theirs_ms = median_ms(step(theirs), args.iters)
        rows.append((s, b, h, ours_ms, theirs_ms))
    if rank == 0:
        print(f"\nTP MLP block, {world} Gloo ranks, forward+backward, median of {args.iters} "
              f"(max over ranks), torch {torch.__version__}")
        print(f"{'shape [s,b,h]':>16} {'ours ms':>9} {'DTensor ms':>11} {'DTensor/ours':>13}")
        for s, b, h, o, t in rows:
            print(f"{str([s, b, h]):>16} {o:>9.2f} {t:>11.2f} {t / o:>12.2f}x")
    mapp.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
