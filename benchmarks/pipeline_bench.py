"""Pipeline schedules on 4 real Gloo ranks with emulated compute.

Each stage's compute is a fixed-duration wait (so the 2-core machine does not
bound it): forward sleeps F, the input-gradient backward sleeps BI and the
weight-gradient backward sleeps W (deferred by our executor under zero-bubble
schedules, split by torch's own machinery under its zero-bubble schedules).
Activations of [micro_batch, 256, 256] float32 (1 MiB) really travel over Gloo.

Measured per step (median over steps, slowest rank): ours (GPipe, 1F1B,
interleaved, ZB-H1, dynamic) next to torch.distributed.pipelining (ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble), the
simulator's prediction of each of our plans, and peak live activations; then
the same with one stage slowed 1.5x.

    python benchmarks/pipeline_bench.py            # ~2 minutes
    python benchmarks/pipeline_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

import torch
from torch import nn

P = 4
ROW = 256


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class _Input(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f, bi):
        ctx.bi = bi
        _sleep(f)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        _sleep(ctx.bi)
        return dy, None, None


class SleepChunk(nn.Module):
    def __init__(self, f: float, bi: float, bw: float):
        super().__init__()
        self.f, self.bi, self.bw = f, bi, bw
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        if not x.requires_grad:  # first stage: pay BI as a real first layer would
            x = x.detach().requires_grad_()
        w = _WeightWithParam.apply(self.w, self.bw)
        return _Input.apply(x, self.f, self.bi) + w.sum() * 0


class _WeightWithParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, bw):
        ctx.bw = bw
        ctx.save_for_backward(w)
        return w.clone()

    @staticmethod
    def backward(ctx, dy):
        from megatronapp import autograd

        (w,) = ctx.saved_tensors

        def later(dy=dy, bw=ctx.bw):
            _sleep(bw)
            return dy.clone()
        if autograd.defer(w, later):
            return None, None
        _sleep(ctx.bw)
        return dy, None


def _loss(out, target):
    return (out - target).pow(2).mean()


def _stage_costs(args, stage: int, chunks: int, slow: int | None):
    k = 1.5 if stage == slow else 1.0
    ms = args.compute_ms / 1000 * k / chunks
    return ms, ms, ms  # F = BI = W


def _timed(fn, steps: int, warmup: int) -> tuple[float, list]:
    times, results = [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        results.append(fn(i))
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(dt))
    return statistics.median(times), results[warmup:]


def _ours(args, name, v, slow, mb_shape):
    import megatronapp as mapp
    from megatronapp import pipeline as pl

    state = mapp.parallel_state.get_parallel_state()
    stage = state.pp_rank
    chunks = [SleepChunk(*_stage_costs(args, stage, v, slow)) for _ in range(v)]
    m = args.microbatches
    adaptive = None
    if name.startswith("dynamic"):
        policy = name.split(":")[1] if ":" in name else "adaptive"
        limit = int(name.split(":")[2]) if name.count(":") == 2 else None
        if policy == "adaptive":
            adaptive = pl.AdaptiveSchedule(P, m, v, memory_limit=limit, interval=args.warmup)
            sched = adaptive.schedule
        else:
            sched = pl.Schedule.dynamic(P, m, v, policy, limit)
    else:
        sched = pl.Schedule.by_name(name, P, m, v)
    data = [(torch.randn(mb_shape), torch.randn(mb_shape)) for _ in range(m)]

    def step(_):
        nonlocal sched
        r = pl.forward_backward(sched, chunks, iter(data), _loss, tensor_shape=mb_shape)
        if adaptive is not None:
            adaptive.observe(r)  # re-plans every `interval` steps from measured times
            sched = adaptive.schedule
        return r

    t, results = _timed(step, args.steps, args.warmup + (args.warmup if adaptive else 0))
    peak = torch.tensor([max(r.peak_activations for r in results)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    # Measured per-action times of every stage (mean over the timed steps): the
    # simulator's inputs for the calibrated prediction.
    measured = torch.zeros(P, 3, dtype=torch.float64)
    for r in results:
        ct = r.compute_time
        bi, bw = (ct["B"] / 2, ct["B"] / 2) if "B" in ct else (ct.get("BI", 0), ct.get("W", 0))
        measured[stage] += torch.tensor([ct.get("F", 0), bi, bw], dtype=torch.float64) / len(results)
    dist.all_reduce(measured)
    return t, sched, int(peak), measured


def _torch(args, name, v, slow, mb_shape, group):
    from torch.distributed import pipelining as tp

    rank = dist.get_rank()
    m = args.microbatches
    stages = []
    for c in range(v):
        idx = c * P + rank
        mod = SleepChunk(*_stage_costs(args, rank, v, slow))
        stages.append(tp.PipelineStage(mod, idx, P * v, torch.device("cpu"), group=group))
    cls = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B,
           "interleaved": tp.ScheduleInterleaved1F1B,
           "zero-bubble": tp.ScheduleInterleavedZeroBubble}[name]
    sched = cls(stages if v > 1 or name == "zero-bubble" else stages[0], m, loss_fn=_loss)
    full = (mb_shape[0] * m,) + tuple(mb_shape[1:])
    x, y = torch.randn(full), torch.randn(full)
    first, last = rank == 0, rank == P - 1

    def step(_):
        kw = {}
        if last:
            kw["target"] = y
            kw["losses"] = []
        return sched.step(x, **kw) if first else sched.step(**kw)

    t, _ = _timed(step, args.steps, args.warmup)
    return t


def _p2p_time(mb_shape) -> float:
    """One-way time of one activation between stage 0 and 1 (ping-pong / 2)."""
    rank = dist.get_rank()
    buf = torch.randn(mb_shape)
    times = []
    for _ in range(20):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - t0) / 2)
    t = torch.tensor([statistics.median(times) if rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _worker(rank, port, args, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=P, timeout=timedelta(seconds=300))
    import megatronapp as mapp
    from megatronapp import pipeline as pl

    state = mapp.initialize_model_parallel(1, P)
    mb_shape = (args.micro_batch, ROW, ROW)
    p2p = _p2p_time(mb_shape)
    rows = []
    f = args.compute_ms / 1000
    cases = [(None, ["gpipe", "1f1b", "interleaved", "zero-bubble", "dynamic:dfc",
                     "dynamic:auto", "dynamic:adaptive"]),
             *[(s, ["1f1b", "zero-bubble", "dynamic:adaptive", f"dynamic:adaptive:{2 * P}"])
               for s in range(P)]]
    for slow, names in cases:
        for name in names:
            v = 2 if name == "interleaved" else 1
            t, sched, peak, measured = _ours(args, name, v, slow, mb_shape)
            k = [1.5 if s == slow else 1.0 for s in range(P)]
            per = [f * x / v for x in k]
            sim = pl.simulate(sched, forward=per, backward_input=per, backward_weight=per, p2p=p2p)
            cal = pl.simulate(sched, forward=measured[:, 0].tolist(),
                              backward_input=measured[:, 1].tolist(),
                              backward_weight=measured[:, 2].tolist(), p2p=p2p)
            row = {"stack": "megatronapp", "schedule": name, "chunks": v, "slow_stage": slow,
                   "plan": sched.name, "step_s": t, "simulated_s": sim.makespan,
                   "calibrated_s": cal.makespan, "peak_activations": peak}
            base = name.split(":")[0]
            if not name.startswith("dynamic") and slow is None and args.torch:
                try:
                    tv = 2 if base in ("interleaved", "zero-bubble") else 1
                    row["torch_schedule"] = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                                             "interleaved": "ScheduleInterleaved1F1B",
                                             "zero-bubble": "ScheduleInterleavedZeroBubble"}[base]
                    row["torch_chunks"] = tv
                    row["torch_step_s"] = _torch(args, base, tv, slow, mb_shape,
                                                 state.pipeline_group)
                except Exception as e:  # report, do not hide
                    row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        queue.put({"p2p_s": p2p, "rows": rows, "config": vars(args)})
    mapp.destroy_model_parallel()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--compute-ms", type=float, default=12.0, help="F = BI = W per stage")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-torch", dest="torch", action="store_false")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(P)]
    for p in procs:
        p.start()
    out = queue.get(timeout=3600)
    for p in procs:
        p.join()
    rows = out["rows"]
    print(f"\np={P}, m={args.microbatches}, F=BI=W={args.compute_ms} ms per stage, "
          f"one activation {args.micro_batch}x{ROW}x{ROW} fp32, p2p {out['p2p_s'] * 1e3:.2f} ms")
    print(f"{'slow':>4} {'schedule':<22} {'plan':<32} {'step ms':>8} {'sim ms':>7} {'cal ms':>7} "
          f"{'cal err':>7} {'peak':>4} {'torch ms':>9} {'torch/ours':>10}")
    ref = {r["slow_stage"]: r["step_s"] for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        err = r["step_s"] / r["calibrated_s"] - 1
        tt = r.get("torch_step_s")
        print(f"{str(r['slow_stage']):>4} {r['schedule']:<22} {r['plan']:<32} "
              f"{r['step_s'] * 1e3:8.1f} {r['simulated_s'] * 1e3:7.1f} "
              f"{r['calibrated_s'] * 1e3:7.1f} {err:+7.1%} "
              f"{r['peak_activations']:4d} "
              + (f"{tt * 1e3:9.1f} {tt / r['step_s']:10.2f}" if tt else
                 f"{'-':>9} {r.get('torch_error', '-')[:40]:>10}")
              + f"   1F1B/this {ref[r['slow_stage']] / r['step_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
