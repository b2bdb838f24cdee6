"""Context parallelism on CPU: activation memory per rank against sequence
length, and tokens/s at a long sequence, ring (p2p) vs all-to-all vs cp = 1.

    python benchmarks/context_parallel.py [--seq 4096] [--iters 4] [--world 4]

1. Memory: the bytes autograd saves during one forward of a GPT microbatch on
   each rank (saved-tensor hooks: exactly the activations kept for backward),
   for sequence lengths 1K-16K at cp = 1, 2, 4 (4 ranks: cp x dp = 4); the
   longest sequence whose activations fit the budget that cp = 1 needs at 2K.
2. Speed: the same GPT trained through pretrain's loop at --seq, global batch
   4 sequences, on --world ranks as dp = world (cp = 1), cp = world p2p and
   cp = world a2a (one run each, round-robin --repeats); median step after the first, tokens/s,
   and for the ring the share of its exchange time hidden behind compute:
   1 - (time waiting in cp_ring_wait) / (time the same exchanges take alone,
   measured in the same processes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch.multiprocessing as mp

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
         "--eval-iters", "0", "--no-progress", "--log-interval", "100000", "--no-watchdog"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory(rank, world, port, seqs, out):
    import torch.distributed as dist

    import torch
    from megatronapp.models import GPTConfig, GPTModel
    from megatronapp.models.context_parallel import zigzag_split
    from megatronapp.parallel_state import create_parallel_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    res = {}
    for cp in (1, 2, 4):
        state = create_parallel_state(context_parallel_size=cp)
        for s in seqs:
            cfg = GPTConfig(vocab_size=256, hidden_size=128, num_layers=2, num_attention_heads=4,
                            seq_length=s)
            model = GPTModel(cfg, parallel_state=state, seed=0)
            tokens = torch.randint(0, 256, (1, s))
            x = zigzag_split(tokens, cp, state.cp_rank, 1)
            saved = [0]

            def pack(t):
                saved[0] += t.numel() * t.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(x, x).mean()
            del loss
            res[f"{cp}/{s}"] = saved[0]
        for g in (state.tensor_group, state.data_group, state.pipeline_group, state.model_group,
                  state.context_group, state.data_context_group, state.embedding_group):
            if g is not None:
                dist.destroy_process_group(g)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _speed(rank, world, port, flags, seq, iters, out, d):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch.distributed as dist

    import torch
    from megatronapp import trace
    from megatronapp.pretrain import build_parser, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # The ring's exchanges alone, in these processes, before training: one
    # forward ring (cp - 1 K/V exchanges) and one backward ring (cp - 1 K/V and
    # cp dK/dV exchanges) per layer and microbatch.
    alone = 0.0
    if "p2p" in flags:
        from megatronapp.models.context_parallel import _exchange
        from megatronapp.parallel_state import create_parallel_state

        st = create_parallel_state(context_parallel_size=world)
        g = st.context_group
        cp = g.size()
        ranks = dist.get_process_group_ranks(g)
        kv = [torch.randn(1, 4, seq // cp, 32) for _ in range(2)]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(3 * cp - 2):
            _, reqs = _exchange(kv, g, ranks[(g.rank() + 1) % cp], ranks[(g.rank() - 1) % cp])
            for r in reqs:
                r.wait()
        layers, micro = 2, 4  # cp = world: dp = 1, 4 microbatches per step
        alone = (time.perf_counter() - t0) * layers * micro * (iters - 1)
    args = build_parser().parse_args(MODEL + flags + [
        "--seq-length", str(seq), "--train-iters", str(iters), "--output-dir", d,
        "--trace", "--trace-dir", d + "/trace", "--distributed-backend", "gloo"])
    res = train(args)
    steps = [h["seconds"] for h in res["history"][1:]]
    waits = 0.0
    tfile = trace.trace_path(d + "/trace", rank)
    if os.path.exists(tfile):
        from megatronapp.trace.aggregate import load_trace
        for e in load_trace(tfile):
            if e.get("name") == "cp_ring_wait" and e.get("ph") == "X" and \
                    e.get("args", {}).get("iter", 0) >= 1:
                waits += e["dur"] / 1e6
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(steps), "wait_s": waits,
                       "alone_s": alone, "loss": res["losses"][-1]}, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--world", type=int, default=4, choices=(2, 4),
                   help="ranks of the speed runs (cp = world); 2 leaves each rank a core here")
    p.add_argument("--mem-seqs", default="1024,2048,4096,8192,16384")
    a = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "python"))
    world = 4
    tmp = tempfile.mkdtemp()
    seqs = [int(x) for x in a.mem_seqs.split(",")]
    mp.spawn(_memory, args=(world, _port(), seqs, tmp + "/mem.json"), nprocs=world)
    mem = json.load(open(tmp + "/mem.json"))
    print("\nActivation memory per rank (bytes autograd saves in one forward of a 2-layer GPT, "
          "hidden 128, micro-batch 1), MiB:")
    print(f"{'seq':>7} " + " ".join(f"{'cp=' + str(c):>9}" for c in (1, 2, 4)))
    for s in seqs:
        print(f"{s:>7} " + " ".join(f"{mem[f'{c}/{s}'] / 2**20:>9.1f}" for c in (1, 2, 4)))
    budget = mem[f"1/{2048}"] if f"1/{2048}" in mem else mem[f"1/{seqs[0]}"]
    longest = {c: max([s for s in seqs if mem[f"{c}/{s}"] <= budget], default=0)
               for c in (1, 2, 4)}
    print(f"longest sequence within {budget / 2**20:.1f} MiB: " +
          ", ".join(f"cp={c}: {longest[c]}" for c in (1, 2, 4)))
    cp = str(a.world)
    configs = {f"cp=1 (dp={cp})": [],
               f"cp={cp} p2p": ["--context-parallel-size", cp, "--cp-comm-type", "p2p"],
               f"cp={cp} a2a": ["--context-parallel-size", cp, "--cp-comm-type", "a2a"]}
    results = {k: [] for k in configs}
    for _ in range(a.repeats):
        for name, flags in configs.items():
            out = f"{tmp}/{len(results[name])}-{name.replace(' ', '_')}.json"
            mp.spawn(_speed, args=(a.world, _port(), flags, a.seq, a.iters, out,
                                   tempfile.mkdtemp()), nprocs=a.world)
            results[name].append(json.load(open(out)))
    print(f"\nGPT (2 layers, hidden 128, 4 heads) at sequence {a.seq}, 4 sequences per step, "
          f"{a.world} ranks, median step of iterations 2..{a.iters}:")
    base = None
    for name, rs in results.items():
        step = statistics.median(r["step_s"] for r in rs)
        base = base or step
        extra = ""
        alone = sum(r["alone_s"] for r in rs)
        if alone > 0:
            hidden = max(0.0, 1.0 - sum(r["wait_s"] for r in rs) / alone)
            each = "/".join(f"{100 * max(0.0, 1 - r['wait_s'] / r['alone_s']):.0f}" for r in rs)
            extra = f", ring exchanges {100 * hidden:.0f}% hidden behind compute (runs: {each}%)"
        print(f"  {name:<12} {step:7.3f} s/step  {4 * a.seq / step:9.0f} tokens/s  "
              f"{base / step:5.2f}x cp=1{extra}")


if __name__ == "__main__":
    main()
