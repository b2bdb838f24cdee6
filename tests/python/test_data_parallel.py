"""Data-parallel engine on real Gloo ranks: DDP against torch DDP, ZeRO-1
against single-process AdamW, codecs against float64 references."""

import pytest

import torch
from dist_harness import run_ranks


class Net(torch.nn.Module):
    """Mixed dtypes (a float64 layer) and an unused parameter."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 8)
        self.c = torch.nn.Linear(8, 8).double()
        self.unused = torch.nn.Parameter(torch.randn(5))

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(self.b(h).double()).float()


def _ddp_matches_torch(rank, world, overlap):
    import torch.distributed as dist

    import megatronapp as mapp

    torch.manual_seed(0)
    ours_model, ref_model = Net(), Net()
    ref_model.load_state_dict(ours_model.state_dict())
    ours = mapp.data_parallel.DistributedDataParallel(
        ours_model, process_group=dist.group.WORLD, bucket_size_mb=0.0005,
        overlap_grad_reduce=overlap)
    ref = torch.nn.parallel.DistributedDataParallel(ref_model, find_unused_parameters=True)
    assert len(ours.buckets) >= 3  # several buckets, two dtypes
    errs = []
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(6, 12, generator=g) for _ in range(2)]
    # microbatch 1 accumulates without communication, microbatch 2 syncs
    for model in (ours, ref):
        with model.no_sync():
            model(xs[0]).pow(2).sum().backward()
        model(xs[1]).pow(2).sum().backward()
    for p, q in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        if q.grad is None:  # torch leaves never-used grads None; ours are zeros
            errs.append(float(p.grad.abs().max()))
        else:
            errs.append(float((p.grad - q.grad).abs().max()))
    stats = ours.comm_stats()
    return errs, stats["step"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_ddp_gradients_equal_torch_ddp(world, overlap):
    for errs, step in run_ranks(_ddp_matches_torch, world, overlap):
        assert max(errs) < 1e-6, errs
        assert step["raw_bytes"] > 0 and step["sent_bytes"] == step["raw_bytes"]


def _zero1(rank, world):
    import torch.distributed as dist

    import megatronapp as mapp

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    ddp = mapp.data_parallel.DistributedDataParallel(model, process_group=dist.group.WORLD,
                                                     bucket_size_mb=0.001)
    opt = mapp.optimizer.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        x = torch.randn(8 * world, 10, generator=g)  # the global batch, same on every rank
        y = torch.randn(8 * world, 3, generator=g)
        mine = slice(8 * rank, 8 * (rank + 1))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, opt.state_bytes()


def _reference_adamw(world):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        x = torch.randn(8 * world, 10, generator=g)
        y = torch.randn(8 * world, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = sum(v.numel() * v.element_size() for st in opt.state.values()
                for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return flat, state


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_matches_single_process_adamw(world):
    ref, ref_state = _reference_adamw(world)
    res = run_ranks(_zero1, world)
    for flat, state in res:
        assert torch.allclose(flat, ref, atol=1e-5), (flat - ref).abs().max()
        assert torch.equal(flat, res[0][0])  # identical on every rank
        # state of one shard: about 1/dp of the full optimizer's (+ padding, steps)
        assert state <= ref_state / world * 1.15 + 64, (state, ref_state)


def _codec_references(rank, world):

    import megatronapp as mapp

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(4096, generator=g)
    xs = [torch.randn(4096, generator=torch.Generator().manual_seed(1000 + r)) for r in range(world)]
    exact = torch.stack(xs).double().mean(0)
    out = {}
    for spec in ("bf16", "fp16", "int8:64", "onebit:64"):
        y = x.clone()
        mapp.comm.all_reduce(y, compression=spec)
        out[spec] = float((y.double() - exact).norm() / exact.norm())
    # top-k: exactly the mean of every rank's k largest-magnitude entries
    y = x.clone()
    mapp.comm.all_reduce(y, compression="topk:0.05")
    k = 205  # ceil(0.05 * 4096)
    want = torch.zeros(4096, dtype=torch.float64)
    for r in range(world):
        idx = xs[r].abs().topk(k).indices
        want[idx] += xs[r][idx].double()
    out["topk_err"] = float((y.double() - want / world).abs().max())
    # PowerSGD with warm start: the rank-2 approximation of the mean matrix
    # approaches the best rank-2 (truncated SVD) error within a few iterations.
    u = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    v = torch.randn(8, 48, generator=torch.Generator().manual_seed(6))
    scales = torch.tensor([10., 5, 1, .5, .2, .1, .05, .01])
    base = (u * scales) @ v
    mine = base + 0.01 * torch.randn(64, 48, generator=g)
    reducer = mapp.comm.CompressedAllReduce("powersgd:2", numel=64 * 48, layout=[(0, 64, 48)])
    for _ in range(4):
        reducer.state[0].zero_()  # measure the approximation alone, not error feedback
        y = mine.clone()
        reducer(y)
    mats = [base + 0.01 * torch.randn(64, 48, generator=torch.Generator().manual_seed(1000 + r))
            for r in range(world)]
    del mats
    out["powersgd"] = y.double()
    out["mine"] = mine.double()
    return out


def test_codecs_against_float64_reference():
    world = 2
    res = run_ranks(_codec_references, world)
    for r in res:
        assert r["bf16"] < 4e-3 and r["fp16"] < 1e-3
        assert r["int8:64"] < 2e-2
        assert r["onebit:64"] < 1.0  # sign + scale: direction kept, magnitudes coarse
        assert r["topk_err"] < 1e-6
    mean = torch.stack([r["mine"] for r in res]).mean(0)
    svd_err = torch.linalg.svdvals(mean)[2:].pow(2).sum().sqrt()
    ours = (res[0]["powersgd"] - mean).norm()
    assert ours <= 1.5 * svd_err, (float(ours), float(svd_err))
    assert torch.equal(res[0]["powersgd"], res[1]["powersgd"])


def _bad_inputs(rank, world):
    import torch.distributed as dist

    import megatronapp as mapp

    with pytest.raises(ValueError, match="valid specs: none, bf16"):
        mapp.data_parallel.DistributedDataParallel(torch.nn.Linear(2, 2), compression="int4",
                                                   process_group=dist.group.WORLD)
    different = torch.nn.Linear(4, 4 + rank)  # ranks build different models
    with pytest.raises(ValueError, match="differs across data-parallel ranks"):
        mapp.data_parallel.DistributedDataParallel(different, process_group=dist.group.WORLD)
    return True


def test_bad_inputs_are_clear_errors_not_hangs():
    assert all(run_ranks(_bad_inputs, 2, timeout=120))


def _ddp_compressed_many_buckets(rank, world):
    import torch.distributed as dist

    import megatronapp as mapp

    out = {}
    for spec in ("bf16", "int8", "onebit", "topk:0.2", "powersgd:2"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
        ref = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
        ref.load_state_dict(model.state_dict())
        ddp = mapp.data_parallel.DistributedDataParallel(
            model, process_group=dist.group.WORLD, compression=spec, bucket_size_mb=0.002)
        assert len(ddp.buckets) >= 4
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):  # several steps: buckets run back to back on the comm thread
            model.zero_grad(set_to_none=False)
            ddp(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        dist.all_reduce(g)
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        out[spec] = (float((got - g / world).norm() / (g / world).norm()),
                     ddp.comm_stats()["step"])
    return out


def test_compressed_ddp_with_many_buckets_completes_and_is_close():
    for res in run_ranks(_ddp_compressed_many_buckets, 2, timeout=180):
        assert res["bf16"][0] < 1e-2 and res["int8"][0] < 5e-2, res
        for spec, (err, step) in res.items():
            assert err == err and step["sent_bytes"] > 0, (spec, err)  # finite, sent


def _ddp_keeps_user_hooks(rank, world):
    """The engine's readiness hooks sit on the gradient accumulators, next
    to (never replacing) a user's own post-accumulate hooks, registered before
    or after the wrapper; a parameter frozen after wrapping does not hang the
    step (its bucket is submitted at the end of backward)."""
    import torch.distributed as dist

    import megatronapp as mapp

    torch.manual_seed(0)
    model = Net()
    seen = []
    model.a.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(("before", p.grad is not None)))
    ddp = mapp.distributed.DistributedDataParallel(model, process_group=dist.group.WORLD,
                                                   bucket_size_mb=0.0005)
    model.b.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(("after", p.grad is not None)))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, 12, generator=g)
    ddp(x).pow(2).sum().backward()
    # averaged when backward returns: the mean of every rank's gradient
    mine = model.a.weight.grad.clone()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    total = torch.zeros_like(mine)
    for r in range(world):
        ref.zero_grad()
        ref(torch.randn(6, 12, generator=torch.Generator().manual_seed(100 + r))).pow(2).sum() \
            .backward()
        total += ref.a.weight.grad
    err = float((mine - total / world).abs().max())
    first = list(seen)
    model.c.weight.requires_grad_(False)  # frozen after wrapping
    ddp.zero_grad_buffer()
    ddp(x).pow(2).sum().backward()
    return first, err, ddp.synchronized_steps


def test_ddp_adds_to_user_gradient_hooks():
    for seen, err, steps in run_ranks(_ddp_keeps_user_hooks, 2):
        assert sorted(seen) == [("after", True), ("before", True)], seen
        assert err < 1e-5, err
        assert steps == 2


class DeferrableNet(torch.nn.Module):
    """Two of the engine's deferrable linears (the layers of megatronapp's
    models) and a bias-free one: the weights whose gradients may be added into
    the bucket in the GEMM (gradient-accumulation fusion)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(16, 12, generator=g))
        self.b1 = torch.nn.Parameter(torch.randn(16, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(8, 16, generator=g))

    def forward(self, x):
        from megatronapp import autograd

        return autograd.linear(torch.tanh(autograd.linear(x, self.w1, self.b1)), self.w2)


def _fused_accumulation(rank, world, fused, defer, hooked):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import megatronapp as mapp
    from megatronapp import autograd

    model = DeferrableNet()
    seen = []
    # users' hooks: those weights go through AccumulateGrad
    if hooked == "post-accumulate":  # reads w2's gradient
        model.w2.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    elif hooked == "gradient":  # doubles w1's gradient
        model.w1.register_hook(lambda g: g * 2)
    ddp = mapp.distributed.DistributedDataParallel(
        model, process_group=dist.group.WORLD, bucket_size_mb=0.0005,
        gradient_accumulation_fusion=fused)
    xs = [torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(10 * r + m))
          for r in range(world) for m in range(3)]
    mine = xs[3 * rank:3 * rank + 3]

    def backward(x):
        if not defer:
            ddp(x).pow(2).sum().backward()
            return
        store = autograd.WeightGradStore()
        with autograd.deferring(store):  # zero-bubble: BI now, W later
            ddp(x).pow(2).sum().backward()
        autograd.run(store)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):  # the bucket is zeroed between steps, as by the optimizer
            ddp.zero_grad_buffer()
            with ddp.deferred_grad_sync():  # as the pipeline executor drives it
                with ddp.no_sync():
                    for x in mine[:-1]:
                        backward(x)
                backward(mine[-1])  # readiness hooks submit the buckets (in W when deferred)
            ddp.finish_grad_sync()
    in_gemm = sum(e.count for e in prof.key_averages() if e.key == "aten::addmm_")
    # float64 reference: every rank's microbatches, averaged over the ranks
    ref = DeferrableNet().double()
    F = torch.nn.functional
    for x in xs:
        F.linear(torch.tanh(F.linear(x.double(), ref.w1, ref.b1)), ref.w2).pow(2).sum().backward()
    if hooked == "gradient":
        ref.w1.grad *= 2
    errs = [float((p.grad.double() - q.grad / world).abs().max() / q.grad.abs().max())
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    return errs, in_gemm, seen


@pytest.mark.parametrize("defer", [False, True], ids=["1f1b", "deferred-w"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_gradient_accumulation_fusion_adds_weight_gradients_in_the_gemm(fused, defer):
    """--gradient-accumulation-fusion (on by default, as in Megatron-LM): each
    weight gradient is added into its bucket view by one GEMM with beta = 1,
    also when zero-bubble's W pass computes it later; the averaged gradients
    equal a float64 reference, and the bucket is reduced (readiness hooks run
    without AccumulateGrad's add)."""
    for errs, in_gemm, _ in run_ranks(_fused_accumulation, 2, fused, defer, None):
        assert max(errs) < 1e-5, errs
        # 2 weights x 3 microbatches x 2 steps
        assert in_gemm == (12 if fused else 0), in_gemm


@pytest.mark.parametrize("hook", ["post-accumulate", "gradient"])
def test_gradient_accumulation_fusion_leaves_hooked_weights_to_autograd(hook):
    """A weight with a user's hook keeps AccumulateGrad: a post-accumulate hook
    sees its gradient, a gradient hook changes it (doubles it here); the other
    weight is still added in the GEMM."""
    for errs, in_gemm, seen in run_ranks(_fused_accumulation, 2, True, False, hook):
        assert max(errs) < 1e-5, errs
        assert in_gemm == 6, in_gemm
        assert seen == ([True] * 6 if hook == "post-accumulate" else []), seen
