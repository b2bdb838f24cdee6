"""MoE token dispatch + combine: ours (C++ operators) against a plain
``torch.distributed.all_to_all_single`` dispatcher, on uniform, Zipf-skewed
and single-hot routing; and our int8 dispatch against full precision.

    python benchmarks/moe_dispatch.py                      # 4 loopback ranks
    python benchmarks/moe_dispatch.py --two-node           # 2 ranks, 1 Gbit/s link (root)

One process per rank, all variants in one run, round-robin over
``--repeats``, median of ``--iters`` timed forward+backward passes of
dispatch -> (identity experts x 2) -> combine. The baseline is what a
careful user writes with torch alone (Megatron's alltoall dispatcher shape):
stable argsort of the assignments by expert, counts exchanged with
all_to_all_single, rows with all_to_all_single and uneven splits, a
per-(source, expert) regroup with index_select, the reverse, and a weighted
index_add_ of each token's k rows; backward by autograd (all_to_all_single
has no autograd, so a small Function around it).

Prints, per routing: max/mean expert load (the imbalance), microseconds per
token for each variant, and ours' speedup; and bytes sent per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import netns  # benchmarks/netns.py

NS = ("mapp_moe0", "mapp_moe1")
ADDR = ("10.78.0.1", "10.78.0.2")
DEV = ("mapp_mveth0", "mapp_mveth1")
ROUTINGS = ("uniform", "zipf", "single-hot")
VARIANTS = ("torch-a2a", "ours", "ours-int8")


def routing(kind: str, T: int, E: int, k: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        scores = torch.rand(T, E, generator=g)
    elif kind == "zipf":  # expert popularity ~ 1 / rank^1.2
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        scores = torch.rand(T, E, generator=g, dtype=torch.float64).log() / w
    else:  # every token's first choice is expert 0
        scores = torch.rand(T, E, generator=g)
        scores[:, 0] += 10.0
    idx = torch.topk(scores, k, dim=-1).indices
    probs = torch.softmax(torch.rand(T, k, generator=g), dim=-1)
    return idx, probs


class _A2A:
    """all_to_all_single with autograd (the reverse exchange in backward)."""

    @staticmethod
    def apply(x, out_splits, in_splits, group):
        import torch.distributed as dist

        import torch

        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:]))
                dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
                return out

            @staticmethod
            def backward(ctx, g):
                out = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
                dist.all_to_all_single(out, g.contiguous(), in_splits, out_splits, group=group)
                return out
        return F.apply(x)


def torch_moe(x, idx, probs, E, group):
    """The baseline: dispatch, identity experts x 2, combine (pure torch)."""
    import torch.distributed as dist

    import torch

    T, k = idx.shape
    ep = group.size()
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    nl = E // ep
    send = counts.view(ep, nl).sum(1).tolist()
    recv = recv_counts.view(ep, nl).sum(1).tolist()
    rows = x.index_select(0, order // k)
    got = _A2A.apply(rows, recv, send, group)
    # [source][local expert] -> [local expert][source]
    rc = recv_counts.view(ep, nl)
    starts = torch.cumsum(rc.reshape(-1), 0) - rc.reshape(-1)
    perm = torch.cat([torch.arange(int(starts[s * nl + e]), int(starts[s * nl + e] + rc[s, e]))
                      for e in range(nl) for s in range(ep)] or [torch.zeros(0, dtype=torch.long)])
    y = got.index_select(0, perm) * 2.0  # the experts
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    back = _A2A.apply(y.index_select(0, inv), send, recv, group)
    w = probs.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros_like(x)
    out.index_add_(0, order // k, back * w)
    return out


def our_moe(x, idx, probs, E, group, compression):
    from megatronapp.moe import combine, dispatch

    recv, _tpe, plan = dispatch(x, idx, E, compression=compression, group=group)
    return combine(recv * 2.0, probs, plan, group=group)


def rank_main(rank, world, port, master, args):
    if master != "127.0.0.1":
        os.environ["GLOO_SOCKET_IFNAME"] = DEV[rank]
    import torch.distributed as dist

    import megatronapp as mapp
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=world)
    state = mapp.initialize_model_parallel(expert_model_parallel_size=world)
    group, E, k, T, h = state.expert_group, args.experts, 2, args.tokens, args.hidden
    res = {}
    for kind in ROUTINGS:
        idx, probs = routing(kind, T, E, k, seed=rank)
        load = torch.bincount(idx.reshape(-1), minlength=E).double()
        dist.all_reduce(load, group=group)
        x = torch.randn(T, h, generator=torch.Generator().manual_seed(rank))
        # Same numbers (the baseline is a correct implementation).
        a = torch_moe(x, idx, probs, E, group)
        b = our_moe(x, idx, probs, E, group, "none")
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
        times = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v in VARIANTS:
                for it in range(args.warmup + args.iters):
                    xi = x.clone().requires_grad_()
                    pi = probs.clone().requires_grad_()
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    if v == "torch-a2a":
                        out = torch_moe(xi, idx, pi, E, group)
                    else:
                        out = our_moe(xi, idx, pi, E, group,
                                      "int8" if v == "ours-int8" else "none")
                    out.sum().backward()
                    if it >= args.warmup:
                        times[v].append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times[v]) for v in VARIANTS], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
        res[kind] = {"imbalance": float(load.max() / load.mean()),
                     "us_per_token": {v: float(t[i]) * 1e6 / T for i, v in enumerate(VARIANTS)}}
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def launch(args, world, prefix_of, master):
    cmd = [sys.executable, os.path.abspath(__file__), "--port", str(args.port),
           "--master", master, "--world", str(world), "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--experts", str(args.experts),
           "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--repeats", str(args.repeats)]
    procs = [subprocess.Popen(prefix_of(r) + cmd + ["--rank", str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=3600) for p in procs]
    bad = [f"--- rank {r} ---\n{e[-3000:]}" for r, (p, (_o, e)) in
           enumerate(zip(procs, outs, strict=True)) if p.returncode]
    if bad:
        raise SystemExit("\n".join(bad))
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--two-node", action="store_true",
                   help="2 ranks in two network namespaces joined by --rate (root)")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=29720)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--master", default="127.0.0.1")
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.master, args)
        return
    if args.two_node:
        if os.geteuid() != 0:
            raise SystemExit("--two-node needs root (network namespaces and tc)")
        netns.create(NS, DEV, ADDR, args.rate)
        try:
            res = launch(args, 2, lambda r: ["ip", "netns", "exec", NS[r]], ADDR[0])
        finally:
            netns.remove(NS)
        where, world = f"2 ranks over a {args.rate} link", 2
    else:
        res = launch(args, args.world, lambda r: [], "127.0.0.1")
        where, world = f"{args.world} loopback ranks", args.world
    print(f"\nMoE dispatch + combine, forward + backward, {where}: {args.tokens} tokens x "
          f"hidden {args.hidden} per rank, {args.experts} experts, top-2, ep = {world}; "
          f"median of {args.iters} x {args.repeats} round-robin repeats (slowest rank)")
    print(f"{'routing':<11} {'max/mean load':>13} " + " ".join(f"{v:>10}" for v in VARIANTS)
          + f" {'ours vs torch':>14} {'int8 vs ours':>13}   (us per token)")
    for kind, r in res.items():
        us = r["us_per_token"]
        print(f"{kind:<11} {r['imbalance']:>13.2f} " + " ".join(f"{us[v]:>10.2f}" for v in VARIANTS)
              + f" {us['torch-a2a'] / us['ours']:>13.2f}x {us['ours'] / us['ours-int8']:>12.2f}x")
    b = args.hidden * 4
    print(f"bytes per dispatched row: fp32 {b}, int8 {args.hidden + 4 * -(-args.hidden // 256)}")


if __name__ == "__main__":
    main()
