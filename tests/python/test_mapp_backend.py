"""The ``mapp`` torch.distributed backend on real processes: every collective
torch.distributed offers, called the way Megatron-Core, DeepSpeed and DDP call
them, against a float64 closed form and the same call on Gloo; the coalescing
manager, async work and futures, object collectives, point-to-point; the
fallback with MAPP_SHM_COLLECTIVES=0; and pretrain_gpt on it
(--distributed-backend mapp) giving the same losses as on Gloo."""

import os

import pytest

import torch
from dist_harness import assert_no_stack_trace, free_port, run_ranks


def _every_collective(rank, world, env):
    os.environ.update(env)
    import torch.distributed as dist

    import megatronapp
    from megatronapp.distributed.backend import uses_shared_memory

    ranks = list(range(world))
    g = dist.new_group(ranks, backend="mapp")
    ref = dist.new_group(ranks, backend="gloo")
    assert dist.get_backend(g) == "mapp"
    shm = uses_shared_memory(g)
    gen = torch.Generator().manual_seed(11)
    per_rank = [torch.randn(6, 10, generator=gen, dtype=torch.float64) for _ in range(world)]
    mine = per_rank[rank]
    bad = []

    def check(tag, got, want64, gloo=None):
        tol = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-5}.get(got.dtype, 1e-12)
        if not torch.allclose(got.double(), want64.double(), rtol=tol, atol=tol):
            bad.append(f"{tag}: max err {(got.double() - want64.double()).abs().max().item():.3e}")
        # Two addends round once either way: bit-equal to Gloo (integers always).
        if gloo is not None and (world == 2 or not got.is_floating_point()) \
                and not torch.equal(got, gloo):
            bad.append(f"{tag}: differs from Gloo")

    ops = {dist.ReduceOp.SUM: lambda xs: sum(xs), dist.ReduceOp.AVG: lambda xs: sum(xs) / world,
           dist.ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0),
           dist.ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0),
           dist.ReduceOp.PRODUCT: lambda xs: torch.stack(xs).prod(0)}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        scaled = [(p * 100).to(dtype) if dtype == torch.int64 else p.to(dtype) for p in per_rank]
        for op, closed in ops.items():
            if op == dist.ReduceOp.AVG and dtype == torch.int64:
                continue
            x = scaled[rank].clone()
            dist.all_reduce(x, op=op, group=g)
            want = closed([s.double() for s in scaled])
            y = None
            if dtype != torch.bfloat16 and op != dist.ReduceOp.AVG:  # Gloo has neither
                y = scaled[rank].clone()
                dist.all_reduce(y, op=op, group=ref)
            check(f"all_reduce {op} {dtype}", x, want, y)
    nc = mine.float().t()  # not contiguous: reduced in place all the same
    dist.all_reduce(nc, group=g)
    check("all_reduce non-contiguous", nc, sum(per_rank).t())

    b = mine.clone() if rank == 1 else torch.zeros_like(mine)
    dist.broadcast(b, src=1, group=g)
    check("broadcast", b, per_rank[1])
    outs = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(outs, mine, group=g)
    check("all_gather", torch.stack(outs), torch.stack(per_rank))
    flat = torch.empty(world * 6, 10, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, mine, group=g)
    check("all_gather_into_tensor", flat, torch.cat(per_rank))
    full = torch.cat([p * (i + 1) for i, p in enumerate(per_rank)]).float()  # world x [6, 10]
    everyone = [torch.cat([p * (i + 1) for i, p in enumerate(per_rank)]) for _ in ranks]
    out = torch.empty(6, 10)
    dist.reduce_scatter_tensor(out, full, group=g)
    check("reduce_scatter_tensor", out, sum(e.chunk(world)[rank] for e in everyone))
    out2 = torch.empty(6, 10)
    dist.reduce_scatter(out2, list(full.chunk(world)), group=g)
    check("reduce_scatter (list)", out2, out)
    avg = torch.empty(6, 10)
    dist.reduce_scatter_tensor(avg, full, op=dist.ReduceOp.AVG, group=g)
    check("reduce_scatter_tensor avg", avg, out / world)

    # all_to_all: equal chunks, then uneven splits (member i sends i+j+1 rows to j)
    a2a_in = torch.arange(world * 3, dtype=torch.float32) + 100 * rank
    a2a_out = torch.empty_like(a2a_in)
    dist.all_to_all_single(a2a_out, a2a_in, group=g)
    want = torch.cat([torch.arange(world * 3, dtype=torch.float32)[3 * rank:3 * rank + 3] + 100 * m
                      for m in ranks])
    check("all_to_all_single", a2a_out, want)
    send = [rank + j + 1 for j in ranks]
    recv = [m + rank + 1 for m in ranks]
    rows = torch.cat([torch.full((n, 2), float(10 * rank + j)) for j, n in enumerate(send)])
    got = torch.empty(sum(recv), 2)
    dist.all_to_all_single(got, rows, output_split_sizes=recv, input_split_sizes=send, group=g)
    want = torch.cat([torch.full((n, 2), float(10 * m + rank)) for m, n in enumerate(recv)])
    check("all_to_all_single uneven", got, want)
    outs = [torch.empty(rank + 1) for _ in ranks]  # from member m: rank + 1 values of m
    dist.all_to_all(outs, [torch.full((j + 1,), float(rank)) for j in ranks], group=g)
    check("all_to_all (list)", torch.cat(outs), torch.cat([torch.full((rank + 1,), float(m))
                                                          for m in ranks]))

    # Megatron-Core's gradient buffers: coalesced reduce-scatters and all-gathers, async.
    from torch.distributed.distributed_c10d import _coalescing_manager

    grads = [mine.float().clone() * (i + 1) for i in range(3)]
    shards = [torch.empty(6 // world * 10 if 6 % world == 0 else 0) for _ in grads]
    if 6 % world == 0:
        with _coalescing_manager(g, async_ops=True) as cm:
            for gr, sh in zip(grads, shards, strict=True):
                dist.reduce_scatter_tensor(sh, gr.reshape(-1), group=g, async_op=True)
        cm.wait()
        for i, sh in enumerate(shards):
            check(f"coalesced reduce_scatter {i}", sh,
                  (sum(per_rank) * (i + 1)).reshape(-1).chunk(world)[rank])
        params = [torch.empty(60) for _ in shards]
        with _coalescing_manager(g, async_ops=True) as cm:
            for p, sh in zip(params, shards, strict=True):
                dist.all_gather_into_tensor(p, sh, group=g, async_op=True)
        cm.wait()
        for i, p in enumerate(params):
            check(f"coalesced all_gather {i}", p, (sum(per_rank) * (i + 1)).reshape(-1))
    many = [mine.float().clone(), torch.ones(3, dtype=torch.float64) * rank]
    with _coalescing_manager(g, async_ops=True) as cm:
        for t in many:
            dist.all_reduce(t, group=g, async_op=True)
    cm.wait()
    check("coalesced all_reduce f32", many[0], sum(per_rank))
    check("coalesced all_reduce f64", many[1], torch.ones(3) * sum(ranks))

    work = dist.all_reduce(z := torch.ones(5), group=g, async_op=True)
    work.wait()
    fut = work.get_future().wait()
    check("async all_reduce", z, torch.full((5,), float(world)))
    check("async future", fut[0], torch.full((5,), float(world)))

    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank}, group=g)
    if objs != [{"rank": r} for r in ranks]:
        bad.append(f"all_gather_object: {objs}")
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=0, group=g)
    if box != ["from 0"]:
        bad.append(f"broadcast_object_list: {box}")
    if world >= 2:  # point to point: a ring
        to, frm = (rank + 1) % world, (rank - 1) % world
        incoming = torch.empty(4)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), float(rank)), to, g),
                                       dist.P2POp(dist.irecv, incoming, frm, g)])
        for r in reqs:
            r.wait()
        check("send/recv", incoming, torch.full((4,), float(frm)))
    dist.barrier(group=g)
    megatronapp.parallel_state.disable_shared_memory(g)  # no-op for a backend's own segment
    return shm, bad


@pytest.mark.parametrize("world,env", [(2, {}), (3, {"MAPP_SHM_SLOT_BYTES": "256"}),
                                       (2, {"MAPP_SHM_COLLECTIVES": "0"})],
                         ids=["2-ranks", "3-ranks-small-slots", "2-ranks-gloo-only"])
def test_every_collective_matches_closed_form_and_gloo(world, env):
    results = run_ranks(_every_collective, world, env)
    for shm, bad in results:
        assert not bad, bad
        assert shm == (env.get("MAPP_SHM_COLLECTIVES") != "0")
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("mapp-")]


def _mismatch(rank, world):
    import torch.distributed as dist

    import megatronapp  # noqa: F401

    g = dist.new_group(list(range(world)), backend="mapp")
    x = torch.ones(4 if rank == 0 else 5)
    with pytest.raises(RuntimeError, match="issued different collectives"):
        dist.all_reduce(x, group=g)
    with pytest.raises(RuntimeError, match="cannot be used again"):
        dist.all_reduce(torch.ones(4), group=g)
    return True


def test_mismatched_calls_are_an_error_naming_both():
    assert run_ranks(_mismatch, 2) == [True, True]


def _gloo_losses(rank, world, out_dir):
    """The training of _TRAIN_SCRIPT in a warm Gloo rank (no launch of its own)."""
    import torch.distributed as dist

    from megatronapp import parallel_state
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step

    run = build_run(Config.from_args(build_parser().parse_args(
        TRAIN_FLAGS + ["--output-dir", out_dir])))
    try:
        assert dist.get_backend() == "gloo", dist.get_backend()
        return "losses " + str([float(train_step(run, it).loss).hex() for it in range(3)])
    finally:
        parallel_state.destroy_model_parallel()


def test_pretrain_gpt_on_the_mapp_backend_matches_gloo(tmp_path):
    # A fresh world initialized with init_process_group("mapp") (torchrun-style
    # environment), TP2 x DP2: the same losses, bit for bit, as on Gloo (both
    # move this node's collectives through the same shared-memory algorithm).
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_TRAIN_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
         str(tmp_path / "mapp")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_no_stack_trace(out.stdout + out.stderr)
    mapp = [line for line in out.stdout.splitlines() if line.startswith("losses")]
    gloo = run_ranks(_gloo_losses, 4, str(tmp_path / "gloo"))[0]
    assert mapp == [gloo], (mapp, gloo)


TRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--tensor-model-parallel-size", "2", "--lr", "1e-3", "--seed", "3"]

_TRAIN_SCRIPT = f"""
import sys
import torch.distributed as dist
from megatronapp.pretrain import build_parser
from megatronapp.training import Config, build_run, train_step

out_dir = sys.argv[1]
flags = {TRAIN_FLAGS!r} + ["--distributed-backend", "mapp", "--output-dir", out_dir]
run = build_run(Config.from_args(build_parser().parse_args(flags)))
assert dist.get_backend() == "mapp", dist.get_backend()
losses = [train_step(run, it).loss for it in range(3)]
if dist.get_rank() == 0:
    print("losses", [float(x).hex() for x in losses])
"""
