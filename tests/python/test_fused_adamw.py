"""The fused AdamW (megatronapp.optimizer.FusedAdamW, torch.ops.mapp.fused_adamw_)
against a float64 torch.optim.AdamW, its checkpoints against torch's AdamW in
both directions, its errors, and --optimizer-impl fused in training: TP2 x DP2
with ZeRO-1 and with bf16 (its fp32 masters) tracking the torch optimizer."""

import pytest

import torch
from dist_harness import run_ranks, train_variants

SHAPES = [(7, 5), (300,), (64, 33), (1,)]


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SHAPES]


def _groups(ps):  # two groups with their own hyper-parameters
    return [{"params": ps[:2], "weight_decay": 0.1},
            {"params": ps[2:], "weight_decay": 0.0, "lr": 3e-3, "eps": 1e-6}]


def _run(opt, ps, steps, seed=1, skip=()):
    g = torch.Generator().manual_seed(seed)
    for it in range(steps):
        for i, p in enumerate(ps):
            grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.grad = None if (it, i) in skip else grad.to(p.dtype)
        opt.step()


def test_matches_float64_adamw_with_groups_and_missing_grads():
    import megatronapp  # noqa: F401
    from megatronapp.optimizer import FusedAdamW

    ours, ref64, ref32 = _params(), _params(torch.float64), _params()
    kw = {"lr": 1e-2, "betas": (0.9, 0.95)}
    skip = {(1, 0), (2, 3)}  # some steps without a gradient: per-parameter step counts
    _run(FusedAdamW(_groups(ours), **kw), ours, 6, skip=skip)
    _run(torch.optim.AdamW(_groups(ref64), **kw), ref64, 6, skip=skip)
    _run(torch.optim.AdamW(_groups(ref32), **kw), ref32, 6, skip=skip)
    for a, b, c in zip(ours, ref64, ref32, strict=True):
        err, torch_err = (a.double() - b).abs().max().item(), (c.double() - b).abs().max().item()
        assert err < 2e-6, err
        assert err <= 2 * torch_err + 1e-7, (err, torch_err)  # as close as torch's own fp32


def test_checkpoints_move_between_torch_adamw_and_fused():
    import megatronapp  # noqa: F401
    from megatronapp.optimizer import FusedAdamW

    kw = {"lr": 1e-2, "betas": (0.9, 0.95)}
    a, b = _params(), _params()
    oa, ob = FusedAdamW(_groups(a), **kw), torch.optim.AdamW(_groups(b), **kw)
    _run(oa, a, 3)
    _run(ob, b, 3)
    # swap states: fused continues from torch's, torch from fused's
    oa2, ob2 = torch.optim.AdamW(_groups(a), **kw), FusedAdamW(_groups(b), **kw)
    oa2.load_state_dict(oa.state_dict())
    ob2.load_state_dict(ob.state_dict())
    assert set(oa.state_dict()["state"][0]) == set(ob.state_dict()["state"][0])
    _run(oa2, a, 3, seed=2)
    _run(ob2, b, 3, seed=2)
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() < 1e-6


def test_bad_inputs_are_clear_errors():
    import megatronapp  # noqa: F401
    from megatronapp.optimizer import FusedAdamW

    with pytest.raises(ValueError, match="invalid betas"):
        FusedAdamW(_params(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="invalid lr"):
        FusedAdamW(_params(), lr=-1.0)
    ps = _params(torch.bfloat16)
    for p in ps:
        p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="float32"):
        FusedAdamW(ps).step()
    p, g = torch.zeros(4), torch.zeros(5)
    with pytest.raises(ValueError, match="has shape"):
        torch.ops.mapp.fused_adamw_([p], [g], [torch.zeros(4)], [torch.zeros(4)], 1e-3, 0.9,
                                    0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        torch.ops.mapp.fused_adamw_([p], [p.clone()], [p.clone()], [p.clone()], 1e-3, 0.9,
                                    0.999, 1e-8, 0.0, 0)


FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", "3", "--eval-iters", "1",
         "--no-progress", "--no-watchdog", "--tensor-model-parallel-size", "2"]


@pytest.mark.parametrize("extra,tol", [(["--use-distributed-optimizer"], 1e-5),
                                       (["--bf16"], 1e-5)], ids=["zero1", "bf16"])
def test_training_with_the_fused_optimizer_tracks_torch_adamw(tmp_path, extra, tol):
    variants = {"torch": [], "fused": ["--optimizer-impl", "fused"]}
    results = run_ranks(train_variants, 4, FLAGS + extra, variants, str(tmp_path), 3)
    for out in results:
        (ref, _, ref_params), (got, _, params) = out["torch"], out["fused"]
        assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) < tol, (ref, got)
        worst = max((a.float() - b.float()).abs().max().item()
                    for a, b in zip(ref_params, params, strict=True))
        assert worst < (1e-5 if "--bf16" not in extra else 1e-2), worst
