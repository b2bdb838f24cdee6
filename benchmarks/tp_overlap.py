"""--tp-comm-overlap's pieces on CPU ranks: a sequence-parallel MLP (column
linear, GELU, row linear) forward + backward at TP2, each overlap setting
against no overlap, in one run, settings round-robin.

    python benchmarks/tp_overlap.py [--world 2] [--seq 512] [--hidden 1024] [--repeats 5]

Prints the median ms per step of each setting and its ratio to "off"; also the
share of the step the blocking collectives take without overlap (what overlap
could hide at best)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

import torch

SETTINGS = {
    "off": None,
    "bulk only (no pieces)": {"ag": False, "rs": False},
    "all, 1 piece": {"splits": 1},
    "all, 2 pieces": {"splits": 2},
    "all, 4 pieces": {"splits": 4},
}


def _worker(rank, world, port, a, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatronapp as mapp
    from megatronapp import parallel_state as S
    from megatronapp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPCommOverlap

    mapp.initialize_model_parallel(tensor_model_parallel_size=world)
    S.enable_shared_memory(S.get_tensor_model_parallel_group())
    torch.manual_seed(0)
    col = ColumnParallelLinear(a.hidden, 4 * a.hidden, sequence_parallel=True)
    row = RowParallelLinear(4 * a.hidden, a.hidden, sequence_parallel=True)
    x = torch.randn(a.seq // world, a.batch, a.hidden, requires_grad=True)

    def step():
        y = row(torch.nn.functional.gelu(col(x)))
        y.sum().backward()

    times = {k: [] for k in SETTINGS}
    for _ in range(a.repeats):
        for name, kw in SETTINGS.items():
            ov = None if kw is None else TPCommOverlap(**kw)
            col.tp_comm_overlap = row.tp_comm_overlap = ov
            for _ in range(3):
                step()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                step()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / a.iters * 1e3)
    # the blocking collectives alone, as "off" issues them
    g = S.get_tensor_model_parallel_group()
    shard = torch.randn(a.seq // world, a.batch, a.hidden)
    full = torch.randn(a.seq, a.batch, a.hidden)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        for _ in range(2):  # forward and backward: 2 gathers, 2 scatters of [s, b, h]
            torch.ops.mapp.all_gather(shard, 0, g.group_name)
            torch.ops.mapp.reduce_scatter(full, 0, g.group_name)
    dist.barrier()
    comm = (time.perf_counter() - t0) / a.iters * 1e3
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in times.items()}, comm=comm)
    mapp.destroy_model_parallel()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(a.world, port, a, out), nprocs=a.world, join=True)
    off = out["off"]
    print(f"TP{a.world} SP MLP, seq {a.seq} x batch {a.batch}, hidden {a.hidden} "
          f"(ffn {4 * a.hidden}), {a.repeats} round-robin repeats of {a.iters} steps")
    print(f"blocking collectives alone: {out['comm']:.2f} ms per step "
          f"({out['comm'] / off:.0%} of the step without overlap)")
    for name in SETTINGS:
        print(f"{name:24s} {out[name]:8.2f} ms  {off / out[name]:5.2f}x off")


if __name__ == "__main__":
    main()
