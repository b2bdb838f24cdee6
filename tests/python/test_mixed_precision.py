"""Mixed precision: bf16/fp16 parameters with float32 main gradients and
master weights (MixedPrecisionOptimizer, and ZeRO-1's DistributedOptimizer),
fp16 loss scaling with Megatron's hysteresis, and bf16 training tracking fp32.

References are independent: float32 sums of the bf16 gradients of separate
backward passes, torch's own AdamW on an fp32 copy of the master weights, and
the fp32 run of the same model, batches and schedule."""

import pytest

import torch
from dist_harness import run_ranks


def test_dynamic_scaler_follows_megatron_hysteresis_and_growth():
    from megatronapp.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    s = DynamicGradScaler(initial_scale=1024, min_scale=256, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024  # one overflow is absorbed by the hysteresis
    s.update(True)
    assert s.scale == 512  # the second halves
    s.update(True)
    assert s.scale == 256  # hysteresis stays spent until a growth refills it
    s.update(True)
    assert s.scale == 256  # never below min_scale
    for _ in range(3):
        s.update(False)
    assert s.scale == 512  # a window of clean steps doubles, hysteresis refilled
    s.update(True)
    assert s.scale == 512
    state = s.state_dict()
    t = DynamicGradScaler(initial_scale=1024, min_scale=256, growth_interval=3, hysteresis=2)
    t.load_state_dict(state)
    t.update(True)
    assert t.scale == 256
    c = ConstantGradScaler(8.0)
    c.update(True)
    assert c.scale == 8.0
    with pytest.raises(ValueError, match="min loss scale"):
        DynamicGradScaler(initial_scale=1.0, min_scale=2.0)


def _model(dtype):
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8)).to(dtype)


def _main_grads_and_master_step(rank, world, zero):
    import megatronapp as mapp
    from megatronapp.distributed.data_parallel import DistributedDataParallel
    from megatronapp.optimizer import DistributedOptimizer, MixedPrecisionOptimizer
    from megatronapp.training import finalize_model_grads

    mapp.initialize_model_parallel()  # dp = world
    bf = _model(torch.bfloat16)
    ddp = DistributedDataParallel(bf, grad_reduce_in_fp32=True, bucket_size_mb=0.001)
    cls = DistributedOptimizer if zero else MixedPrecisionOptimizer
    opt = cls(ddp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    bad = []
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(4, 16, generator=g).bfloat16() for _ in range(2)]
    # Reference main gradient: the fp32 sum of each microbatch's bf16
    # gradient (separate backward passes), averaged over the ranks.
    ref_model = _model(torch.bfloat16)
    want = [torch.zeros(p.shape) for p in ref_model.parameters()]
    for x in xs:
        ref_model.zero_grad()
        ref_model(x).float().square().mean().backward()
        for w, p in zip(want, ref_model.parameters(), strict=True):
            w += p.grad.float()
    for w in want:
        torch.distributed.all_reduce(w)
        w /= world
    index = {id(p): i for i, p in enumerate(bf.parameters())}
    masters0 = [p.detach().float().clone() for p in bf.parameters()]
    opt.zero_grad()
    with ddp.no_sync():
        ddp(xs[0]).float().square().mean().backward()
    ddp(xs[1]).float().square().mean().backward()
    if any(p.grad is not None for p in bf.parameters()):
        bad.append("param.grad survives the hook")
    pairs = finalize_model_grads(ddp, optimizer=opt)
    shards = opt.shards()
    for sh, (p, grad) in zip(shards, pairs, strict=True):
        w = want[index[id(p)]].reshape(-1)[sh.lo:sh.hi]
        if grad.dtype != torch.float32 or not torch.allclose(grad, w, rtol=1e-5, atol=1e-7):
            bad.append(f"main gradient off by {(grad - w).abs().max().item():.2e}")
    opt.step()
    # Reference step: torch's AdamW on fp32 copies of the master weights.
    ref = [m.clone().requires_grad_() for m in masters0]
    for r, w in zip(ref, want, strict=True):
        r.grad = w.clone()
    torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1).step()
    for sh in shards:
        r = ref[index[id(sh.param)]].detach().reshape(-1)[sh.lo:sh.hi]
        if not torch.allclose(sh.main, r, rtol=1e-5, atol=1e-6):
            bad.append(f"fp32 master differs from AdamW's by {(sh.main - r).abs().max():.2e}")
        if not torch.equal(sh.param.detach().reshape(-1)[sh.lo:sh.hi], sh.main.bfloat16()):
            bad.append("bf16 parameter is not the rounded fp32 master")
    # Every rank ends with the same parameters (ZeRO-1: all-gathered).
    for p in bf.parameters():
        every = [torch.empty_like(p) for _ in range(world)]
        torch.distributed.all_gather(every, p.detach().contiguous())
        if not all(torch.equal(e, every[0]) for e in every):
            bad.append("ranks disagree on the parameters")
    n = sum(sh.hi - sh.lo for sh in shards)
    total = sum(p.numel() for p in bf.parameters())
    if (n < total) != zero:
        bad.append(f"owns {n} of {total} master values (zero={zero})")
    return bad


@pytest.mark.parametrize("zero", [False, True], ids=["full", "zero1"])
def test_fp32_main_gradients_and_master_weights_match_references(zero):
    for bad in run_ranks(_main_grads_and_master_step, 2, zero):
        assert not bad, bad


def _fp16_overflow_is_skipped(rank, world, zero, hysteresis):
    import megatronapp as mapp
    from megatronapp.distributed.data_parallel import DistributedDataParallel
    from megatronapp.optimizer import DistributedOptimizer, MixedPrecisionOptimizer
    from megatronapp.optimizer.grad_scaler import DynamicGradScaler

    mapp.initialize_model_parallel()
    model = _model(torch.float16)
    ddp = DistributedDataParallel(model, grad_reduce_in_fp32=True)
    cls = DistributedOptimizer if zero else MixedPrecisionOptimizer
    opt = cls(ddp, torch.optim.AdamW, lr=1e-2,
              grad_scaler=DynamicGradScaler(initial_scale=2.0**10, hysteresis=hysteresis))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).half()
    log = []
    for step in range(3):
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        loss = ddp(x).float().square().mean() * opt.loss_scale
        if step == 1 and rank == 1:  # one rank overflows: every rank must skip
            loss = loss * float("inf")
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)
        stepped = opt.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(),
                                                             strict=True))
        log.append((stepped, changed, opt.grad_scaler.scale, norm == norm and norm < 1e30))
    return log, opt.skipped_steps


@pytest.mark.parametrize("zero", [False, True], ids=["full", "zero1"])
def test_fp16_overflow_skips_the_step_and_halves_the_scale(zero):
    for log, skipped in run_ranks(_fp16_overflow_is_skipped, 2, zero, 1):
        assert skipped == 1
        assert log[0][:3] == (True, True, 2.0**10)
        assert log[1][:3] == (False, False, 2.0**9)  # skipped, parameters untouched, halved
        assert log[2][:3] == (True, True, 2.0**9)
        assert log[0][3] and log[2][3]  # unscaled norms are finite and sane
    # Megatron's default hysteresis (2): the first overflow is absorbed.
    for log, skipped in run_ranks(_fp16_overflow_is_skipped, 2, zero, 2):
        assert skipped == 1 and log[1][:3] == (False, False, 2.0**10)


def _needs_fp32_main_gradients(rank, world):
    from megatronapp.distributed.data_parallel import DistributedDataParallel
    from megatronapp.optimizer import MixedPrecisionOptimizer

    ddp = DistributedDataParallel(_model(torch.bfloat16))
    with pytest.raises(ValueError, match="grad_reduce_in_fp32=True"):
        MixedPrecisionOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    return True


def test_bf16_needs_fp32_main_gradients():
    assert run_ranks(_needs_fp32_main_gradients, 1) == [True]


# 2 layers of 64 (was 4 of 128): bf16 ends 0.4-0.7% from fp32 here, the bound
# is 2%; 29 s instead of 50 s for both layouts.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "20", "--eval-iters", "4",
         "--no-progress", "--log-interval", "1000"]


def _train(rank, world, extra, out_dir):
    from megatronapp.pretrain import build_parser, train

    s = train(build_parser().parse_args(MODEL + extra + ["--output-dir", out_dir]))
    return s["losses"], s["valid_loss"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
     "--grad-compression", "int8"],
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--pipeline-schedule", "zero-bubble"],
], ids=["tp2xdp2-zero1-int8", "tp2xpp2-zb"])
def test_bf16_tracks_fp32(tmp_path, layout, iters=100):
    """bf16 with fp32 main gradients and master weights ends within 2% of the
    fp32 run's validation loss (the issue's 200-step version is
    benchmarks/precision.py; here 100 steps keep the suite short)."""
    steps = ["--train-iters", str(iters)]
    (f_losses, f_valid), *_ = run_ranks(_train, 4, layout + steps, str(tmp_path / "fp32"))
    (b_losses, b_valid), *_ = run_ranks(_train, 4, layout + steps + ["--bf16"],
                                        str(tmp_path / "bf16"))
    assert b_losses[-1] < b_losses[0] - 1.0, b_losses  # it learns
    assert abs(b_valid - f_valid) / f_valid < 0.02, (b_valid, f_valid)
