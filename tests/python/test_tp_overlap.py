"""--tp-comm-overlap: the sequence-parallel linears with their collectives
pipelined behind the GEMMs (megatronapp.tensor_parallel.overlap).

- The asynchronous dim-0 collectives against the blocking ones, on shared
  memory and on Gloo (float32 and bfloat16), and their errors.
- The column and row linears under every overlap setting (pieces that divide
  the sequence and ones that do not, rs_dgrad, bulk on/off) against one
  process's float64 nn.Linear at 1e-12, also with zero-bubble's deferred
  weight gradients.
- Training: with --tp-comm-overlap the losses, gradients and weights equal
  those without it, bit for bit, at TP2 with SP, TP2 x DP2 ZeRO-1 (SwiGLU,
  RMSNorm), TP2 x CP2 with one query group, and TP2 x PP2 zero-bubble with
  recompute; every sequence-parallel linear overlaps; the flag's refusals.
"""

import pytest

import torch
from dist_harness import assert_variants_identical, run_ranks, train_variants


def _async_collectives(rank, world):
    import megatronapp as mapp
    from megatronapp import parallel_state as S

    mapp.initialize_model_parallel(tensor_model_parallel_size=world)
    group = S.get_tensor_model_parallel_group()
    S.enable_shared_memory(group)
    assert torch.ops.mapp.shm_attached(group.group_name)
    out = {}
    for transport in ("shm", "gloo"):
        if transport == "gloo":
            S.disable_shared_memory(group)
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(rank)
            x = torch.randn(6, 3, 5).to(dtype)
            g = x.new_empty((world * 6, 3, 5))
            w1 = torch.ops.mapp.all_gather_async(g, x, group.group_name)
            r = x.new_empty((6 // world, 3, 5))
            w2 = torch.ops.mapp.reduce_scatter_async(r, x, group.group_name)
            torch.ops.mapp.wait_comm(w1)
            w2.wait()
            out[(transport, str(dtype))] = (
                torch.equal(g, torch.ops.mapp.all_gather(x, 0, group.group_name)),
                torch.equal(r, torch.ops.mapp.reduce_scatter(x, 0, group.group_name)))
    errors = []
    for make in (lambda: torch.ops.mapp.all_gather_async(torch.empty(5, 3), torch.empty(2, 3),
                                                         group.group_name),
                 lambda: torch.ops.mapp.reduce_scatter_async(torch.empty(1, 3), torch.empty(3, 3),
                                                             group.group_name),
                 lambda: torch.ops.mapp.all_gather_async(torch.empty(4, 3),
                                                         torch.empty(3, 2).t(), group.group_name)):
        try:
            make()
        except ValueError as e:
            errors.append(str(e).splitlines()[0])
    return out, errors


def test_async_collectives_equal_blocking_ones():
    for out, errors in run_ranks(_async_collectives, 2):
        assert all(a and b for a, b in out.values()), out
        assert len(errors) == 3, errors
        assert "out has shape [5, 3], expected [4, 3]" in errors[0]
        assert "not divisible by the group size 2" in errors[1]
        assert "needs contiguous tensors" in errors[2]


SETTINGS = {
    "all, 4 pieces": {},
    "all, 1 piece": {"splits": 1},
    "all, 3 -> 2 pieces": {"splits": 3},  # 4 local rows: 3 does not divide, 2 is used
    "rs_dgrad": {"rs_dgrad": True, "splits": 2},
    "no pipelining, bulk only": {"ag": False, "rs": False},
    "nothing overlapped": {"ag": False, "rs": False, "bulk_dgrad": False, "bulk_wgrad": False},
}


def _layers(rank, world, deferred):
    import megatronapp as mapp
    from megatronapp import autograd
    from megatronapp.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        TPCommOverlap,
        load_full_state_dict,
    )

    mapp.initialize_model_parallel(tensor_model_parallel_size=world)

    torch.manual_seed(3)
    s, b, h, f = 4 * world, 2, 6, 4 * world
    ref1 = torch.nn.Linear(h, f).double()
    ref2 = torch.nn.Linear(f, h).double()
    x = torch.randn(s, b, h, dtype=torch.float64)
    gy = torch.randn(s, b, h, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    (ref2(torch.relu(ref1(xr))) * gy).sum().backward()

    def shard(t, dim):
        return t.chunk(world, dim)[rank].contiguous()

    errs = {}
    for name, kw in SETTINGS.items():
        ov = TPCommOverlap(**kw)
        col = ColumnParallelLinear(h, f, sequence_parallel=True, tp_comm_overlap=ov,
                                   dtype=torch.float64)
        row = RowParallelLinear(f, h, sequence_parallel=True, tp_comm_overlap=ov,
                                dtype=torch.float64)
        load_full_state_dict(col, ref1.state_dict())
        load_full_state_dict(row, ref2.state_dict())
        xin = shard(x, 0).requires_grad_()
        y = row(torch.relu(col(xin)))
        store = autograd.WeightGradStore()
        if deferred:
            with autograd.deferring(store):
                (y * shard(gy, 0)).sum().backward()
            assert len(store) == 2 and col.weight.grad is None
            autograd.run(store)
        else:
            (y * shard(gy, 0)).sum().backward()
        want_y = shard(ref2(torch.relu(ref1(x))).detach(), 0)
        pairs = [(y.detach(), want_y), (xin.grad, shard(xr.grad, 0)),
                 (col.weight.grad, shard(ref1.weight.grad, 0)),
                 (col.bias.grad, shard(ref1.bias.grad, 0)),
                 (row.weight.grad, shard(ref2.weight.grad, 1)),
                 # a partial sum over the group under SP (finished with the gradients)
                 (row.bias.grad, shard(gy, 0).sum((0, 1)))]
        errs[name] = [(a - w).abs().max().item() for a, w in pairs]
    return errs


@pytest.mark.parametrize("deferred", [False, True], ids=["now", "deferred-wgrad"])
def test_overlapped_linears_match_float64_reference(deferred):
    for errs in run_ranks(_layers, 2, deferred):
        assert set(errs) == set(SETTINGS)
        bad = {k: v for k, v in errs.items() if not max(v) < 1e-12}
        assert not bad, bad


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2"]
BASE = MODEL + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--eval-interval",
                "0", "--lr", "1e-3", "--seed", "5"]
LAYOUTS = {
    "tp2-sp": (2, ["--global-batch-size", "4"]),
    "tp2-dp2-zero1": (4, ["--global-batch-size", "8", "--use-distributed-optimizer",
                          "--swiglu", "--normalization", "RMSNorm"]),
    # context parallelism, and one query group replicated over the tensor group (_GroupedQKV)
    "tp2-cp2-gqa1": (4, ["--global-batch-size", "4", "--context-parallel-size", "2",
                         "--group-query-attention", "--num-query-groups", "1"]),
    "tp2-pp2-zb-recompute": (4, ["--global-batch-size", "8", "--pipeline-model-parallel-size",
                                 "2", "--pipeline-schedule", "zero-bubble",
                                 "--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"]),
}


def _overlapped(rank, world, flags, out_dir):
    """How many linears of the built run overlap, and how many async
    collectives one training step issues."""
    import megatronapp
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step

    run = build_run(Config.from_args(build_parser().parse_args(flags + ["--output-dir", out_dir])))
    layers = [m for c in run.chunks for m in c.modules()
              if getattr(m, "tp_comm_overlap", None) is not None]
    calls = {"all_gather_async": 0, "reduce_scatter_async": 0}
    real = {k: getattr(torch.ops.mapp, k) for k in calls}

    def spy(name):
        def call(*a):
            calls[name] += 1
            return real[name](*a)
        return call
    from megatronapp.tensor_parallel import overlap
    try:
        for k in calls:
            setattr(overlap, f"_{k}_op", spy(k))
        train_step(run, 0)
    finally:
        for k in calls:
            setattr(overlap, f"_{k}_op", real[k])
    megatronapp.destroy_model_parallel()
    return len(layers), calls


def test_training_overlaps_every_sequence_parallel_linear(tmp_path):
    for n, calls in run_ranks(_overlapped, 2, BASE + ["--global-batch-size", "4",
                                                      "--tp-comm-overlap"], str(tmp_path)):
        # the model (its tied output layer) + 2 layers x (qkv, proj, fc1, fc2)
        assert n == 9, n
        # per microbatch (2): 5 column linears (qkv, fc1, the output) gather in 4 pieces
        # forward and gather their input once backward, scattering its gradient once;
        # 4 row linears (proj, fc2) scatter in 4 pieces forward and gather in 4 backward
        per_mb_ag = 5 * 4 + 5 + 4 * 4
        per_mb_rs = 5 + 4 * 4
        assert calls == {"all_gather_async": 2 * per_mb_ag,
                         "reduce_scatter_async": 2 * per_mb_rs}, calls


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_with_overlap_is_bit_identical(layout, tmp_path):
    world, extra = LAYOUTS[layout]
    variants = {"off": [], "on": ["--tp-comm-overlap"],
                "on, rs-dgrad, 2 pieces": ["--tp-comm-overlap", "--tp-comm-overlap-rs-dgrad",
                                           "--tp-comm-overlap-splits", "2"]}
    res = run_ranks(train_variants, world, BASE + extra, variants, str(tmp_path), 3)
    assert_variants_identical(res, list(variants))


def test_tp_comm_overlap_refusals():
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    def check(flags, world=2):
        cfg = Config.from_args(build_parser().parse_args(MODEL + flags))
        with pytest.raises(ConfigError) as e:
            cfg.check(world)
        return str(e.value)

    assert "needs --sequence-parallel" in check(["--tensor-model-parallel-size", "2",
                                                 "--tp-comm-overlap"])
    assert "--tensor-model-parallel-size >= 2 (got 1)" in check(
        ["--sequence-parallel", "--tp-comm-overlap"], world=1)
    assert "add it" in check(["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--disable-tp-comm-bulk-wgrad"])
    assert "--tp-comm-overlap-splits must be >= 1" in check(
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap",
         "--tp-comm-overlap-splits", "0"])
    assert "--fp8-format" in check(["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--tp-comm-overlap", "--fp8-format", "hybrid"])
