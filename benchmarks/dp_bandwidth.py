"""Bandwidth-bound data parallelism: 2 "nodes" joined by a 1 Gbit/s link.

    sudo-less root: python benchmarks/dp_bandwidth.py [--rate 1gbit] [--steps 30]

Creates two network namespaces joined by a veth pair shaped with `tc tbf`,
starts one rank in each (Gloo over the shaped link), and trains the same GPT
(same seeds, same data order) with, in one run:

* torch DDP, uncompressed;
* torch DDP with its PowerSGD communication hook (rank 4);
* megatronapp DDP (with its CPU memory pool), uncompressed and with each codec.

Prints step time (median after warm-up), tokens/s, bytes sent per step and
the loss after the last step, then the ratio to uncompressed torch DDP. The
namespaces are removed afterwards.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import netns  # benchmarks/netns.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = ("mapp_bw0", "mapp_bw1")
ADDR = ("10.77.0.1", "10.77.0.2")
DEV = ("mapp_veth0", "mapp_veth1")
MODEL = dict(num_layers=3, hidden_size=768, num_attention_heads=12, seq_length=64)
BATCH, WARMUP = 4, 4
CODECS = ["none", "bf16", "int8", "onebit:32", "topk:0.01", "powersgd:4"]


def setup(rate):
    netns.create(NS, DEV, ADDR, rate)


def teardown():
    netns.remove(NS)


# ---- one rank ------------------------------------------------------------------------

def rank_main(rank, port, steps, modes, local=False):
    if not local:
        os.environ["GLOO_SOCKET_IFNAME"] = DEV[rank]
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    import megatronapp as mapp
    import torch
    from megatronapp.data import TextDataset, default_corpus
    from megatronapp.models import GPTConfig, GPTModel

    torch.set_num_threads(1)
    master = "127.0.0.1" if local else ADDR[0]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=2)
    state = mapp.initialize_model_parallel()
    data = TextDataset(default_corpus(), MODEL["seq_length"])
    results = {}
    for mode in modes:
        if (not mode.startswith("torch") and not mapp.memory.is_installed("cpu")
                and not os.environ.get("MAPP_BW_NO_POOL")):
            # Ours runs with its memory pool (baselines ran first, on torch's allocator):
            # codec buffers then come from the cache instead of fresh, page-faulting mmaps.
            mapp.memory.use_pool("cpu")
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(vocab_size=256, **MODEL), parallel_state=state)
        if mode == "torch":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        elif mode == "torch-powersgd":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
            ps = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                    start_powerSGD_iter=WARMUP - 2, use_error_feedback=True,
                                    warm_start=True)
            wrapped.register_comm_hook(ps, psgd.powerSGD_hook)
        else:
            comp = None if mode == "none" else mapp.comm.Compression(mode, WARMUP - 2)
            wrapped = mapp.data_parallel.DistributedDataParallel(
                model, process_group=state.data_group, compression=comp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times, loss = [], None
        sent = 0
        for it in range(steps):
            tokens, labels = data.global_batch("train", it, 2 * BATCH, 0)
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            out = wrapped(tokens[mine], labels[mine]).mean()
            out.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            lt = out.detach().clone()
            dist.all_reduce(lt)
            loss = float(lt) / 2
            if hasattr(wrapped, "comm_stats"):
                sent = wrapped.comm_stats()["step"]["sent_bytes"]
        params = sum(p.numel() for p in model.parameters())
        if mode in ("torch", "torch-powersgd"):
            sent = params * 4 if mode == "torch" else None  # ring: ~1x the buffer per rank
        results[mode] = {"step_s": statistics.median(times[WARMUP:]), "loss": loss,
                         "sent_bytes": sent, "params": params}
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--local", action="store_true", help="(debug) loopback, no namespaces")
    p.add_argument("--port", type=int, default=29700)
    # torch-powersgd is off by default: on Gloo (CPU) torch's hook fails with a collective
    # size mismatch inside its own callbacks (see benchmarks/RESULTS.md).
    p.add_argument("--modes", default=",".join(["torch"] + CODECS))
    args = p.parse_args()
    modes = args.modes.split(",")
    if args.rank is not None:
        rank_main(args.rank, args.port, args.steps, modes, args.local)
        return
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces and tc)")
    setup(args.rate)
    try:
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", NS[r], sys.executable, __file__, "--rank", str(r),
             "--port", str(args.port), "--steps", str(args.steps), "--modes", args.modes],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [pr.communicate(timeout=3600) for pr in procs]
        failed = [f"--- rank {r} (exit {pr.returncode}) ---\n{err[-3000:]}"
                  for r, (pr, (_out, err)) in enumerate(zip(procs, outs, strict=True))
                  if pr.returncode != 0]
        if failed:
            raise SystemExit("\n".join(failed))
        line = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")][-1]
        res = json.loads(line[len("RESULT "):])
    finally:
        teardown()
    base = res["torch"]["step_s"]
    tokens = 2 * BATCH * MODEL["seq_length"]
    print(f"\n2 ranks over a {args.rate} link (tc tbf), GPT {res['torch']['params'] / 1e6:.1f}M "
          f"params, {args.steps} steps, median step after {WARMUP} warm-up steps")
    print(f"{'stack':<22} {'step s':>8} {'tokens/s':>9} {'MB sent/step':>13} {'loss':>7} "
          f"{'speedup vs torch DDP':>21}")
    for mode, r in res.items():
        label = mode if mode.startswith("torch") else f"ours {mode}"
        mb = "-" if r["sent_bytes"] is None else f"{r['sent_bytes'] / 1e6:.2f}"
        print(f"{label:<22} {r['step_s']:>8.3f} {tokens / r['step_s']:>9.0f} {mb:>13} "
              f"{r['loss']:>7.3f} {base / r['step_s']:>20.2f}x")


if __name__ == "__main__":
    main()
