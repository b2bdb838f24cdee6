"""The intra-node transports side by side: Gloo (TCP loopback) against our
shared memory, for the two things a pipelined, tensor-parallel step moves —
point-to-point messages between stages and all-reduces within a group.

    python benchmarks/shm_transport.py [--ranks 2] [--iters 200]

In one run, on the same processes and message sizes:

* ping-pong: rank 0 sends, rank 1 receives and sends back (pipeline
  activations and gradients); reported as one-way time per message and the
  bandwidth it implies;
* all-reduce (sum, float32) of the same bytes over all ranks.

Gloo goes through torch.distributed (isend/irecv, all_reduce); shared memory
through torch.ops.mapp.shm_isend/shm_irecv and the C++ collectives. Prints a
table with the ratio Gloo / shared memory per row.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
from dist_harness import run_ranks  # noqa: E402

SIZES = (16 << 10, 512 << 10, 4 << 20)  # bytes


def _rank(rank, world, iters):
    import torch.distributed as dist

    import megatronapp  # noqa: F401
    import torch
    from megatronapp import _collectives as C
    from megatronapp import parallel_state as S

    torch.set_num_threads(1)
    gloo = dist.new_group(list(range(world)))
    shm = dist.new_group(list(range(world)))
    assert S.enable_shared_memory(shm) and S.enable_shared_memory(shm, p2p=True)
    rows = []
    for size in SIZES:
        x = torch.randn(size // 4)
        buf = torch.empty_like(x)

        def pingpong_gloo():
            if rank == 0:
                dist.isend(x, 1, group=gloo, tag=1).wait()
                dist.irecv(buf, 1, group=gloo, tag=2).wait()
            elif rank == 1:
                dist.irecv(buf, 0, group=gloo, tag=1).wait()
                dist.isend(buf, 0, group=gloo, tag=2).wait()

        def pingpong_shm():
            name = shm.group_name
            if rank == 0:
                torch.ops.mapp.shm_isend(x, name, 1, 1).wait()
                torch.ops.mapp.shm_irecv(buf, name, 1, 2).wait()
            elif rank == 1:
                torch.ops.mapp.shm_irecv(buf, name, 0, 1).wait()
                torch.ops.mapp.shm_isend(buf, name, 0, 2).wait()

        def timed(fn, per):
            for _ in range(5):
                fn()
            dist.barrier(group=gloo)
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) / per)
            return statistics.median(ts)

        row = {"bytes": size}
        row["p2p_gloo"] = timed(pingpong_gloo, 2)
        row["p2p_shm"] = timed(pingpong_shm, 2)
        y = x.clone()
        row["allreduce_gloo"] = timed(lambda y=y: C.all_reduce_sum_(y, gloo), 1)
        row["allreduce_shm"] = timed(lambda y=y: C.all_reduce_sum_(y, shm), 1)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run_ranks(_rank, a.ranks, a.iters, timeout=1800)[0]
    print(f"{a.ranks} ranks, median of {a.iters}; p2p: one-way time per message (ping-pong / 2)")
    print("| bytes | p2p Gloo | p2p shared memory | ratio | all-reduce Gloo | "
          "all-reduce shared memory | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        def us(s):
            return f"{s * 1e6:.0f} us"
        gbps = r["bytes"] / r["p2p_shm"] / 1e9
        print(f"| {r['bytes'] >> 10} KiB | {us(r['p2p_gloo'])} | {us(r['p2p_shm'])} "
              f"({gbps:.1f} GB/s) | {r['p2p_gloo'] / r['p2p_shm']:.1f}x | "
              f"{us(r['allreduce_gloo'])} | {us(r['allreduce_shm'])} | "
              f"{r['allreduce_gloo'] / r['allreduce_shm']:.1f}x |")


if __name__ == "__main__":
    main()
