"""--optimizer muon: the Newton-Schulz iteration against a float64
transcription and the polar factor; one step of a run against a hand
computation (momentum, per-group QKV split, shape scale, decoupled decay;
AdamW for embeddings, the output layer and vectors); TP2 x DP2 with
--muon-tp-mode duplicated equals one rank, also under ZeRO-1 (sharded
momentum, whole matrices gathered for the orthogonalization); bf16 with
ZeRO-1 tracks fp32; a checkpoint resumes bit for bit (plain, and ZeRO-1 with
bf16); what Muon cannot run with is refused."""

import math

import pytest

import torch
from dist_harness import error_messages, run_ranks

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "4", "--eval-iters", "1",
         "--no-progress", "--log-interval", "1000", "--optimizer", "muon"]
A, B, C = 3.4445, -4.7750, 2.0315


def _ns64(g, steps=5):
    """The quintic iteration in float64, written out."""
    x = g.double()
    if x.shape[0] > x.shape[1]:
        return _ns64(x.T, steps).T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x


@pytest.mark.parametrize("shape", [(24, 64), (96, 32), (32, 32)])
def test_newton_schulz_is_the_quintic_iteration_and_near_the_polar_factor(shape):
    from megatronapp.optimizer.muon import newton_schulz

    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    o = newton_schulz(g)
    assert o.shape == g.shape and o.dtype == torch.float32
    torch.testing.assert_close(o.double(), _ns64(g), rtol=1e-4, atol=1e-4)
    # U diag(f(s)) V^T with every f(s) in the quintic's band around 1
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    f = torch.diag(u.T @ o.double() @ vh.T)
    assert 0.6 < float(f.min()) and float(f.max()) < 1.25, f
    off = u.T @ o.double() @ vh.T - torch.diag(f)
    assert float(off.abs().max()) < 1e-4  # no mixing of singular directions


def _one_update(rank, world, flags):
    from megatronapp import parallel_state
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step
    from megatronapp.training.hooks import default_hooks

    cfg = Config.from_args(build_parser().parse_args(FLAGS + flags + ["--output-dir", "/tmp/o"]))
    run = build_run(cfg, default_hooks(cfg, 1))
    try:
        named = [(n, p) for c in run.chunks for n, p in c.module.named_parameters()]
        before = {n: p.detach().clone() for n, p in named}
        train_step(run, 0)
        grads = {n: p.grad.detach().clone() for n, p in named}
        after = {n: p.detach().clone() for n, p in named}
        return before, grads, after, type(run.optimizer).__name__
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("nesterov", [False, True])
def test_one_step_is_the_hand_computed_update(nesterov):
    flags = ["--weight-decay", "0.1", "--muon-momentum", "0.9", "--group-query-attention",
             "--num-query-groups", "2"] + (["--muon-nesterov"] if nesterov else [])
    before, grads, after, name = run_ranks(_one_update, 1, flags)[0]
    assert name == "Muon"
    lr, wd, beta = 1e-2, 0.1, 0.9  # iteration 0 of a 1-iteration warm-up: the peak lr
    matrices = 0
    for n, w in before.items():
        g = grads[n].double()
        excluded = "embeddings" in n or "output_layer" in n
        if w.dim() == 2 and not excluded:
            m = (1 - beta) * g
            u = g + beta * (m - g) if nesterov else m
            if n.endswith("qkv.weight"):  # per query group: 2 queries, a key, a value of 8
                blocks = u.view(2, 32, 32).split([16, 8, 8], dim=1)
                o = torch.cat([(_ns64(b.reshape(-1, 32)) * math.sqrt(max(b.shape[1], 32)))
                               .view(b.shape) for b in blocks], dim=1).view(u.shape)
            else:
                o = _ns64(u) * math.sqrt(max(u.shape))
            want = w.double() * (1 - lr * wd) - lr * o
            matrices += 1
        else:  # AdamW's first step: m/(sqrt(v)+eps) = sign(g) (bias-corrected)
            decay = wd if w.dim() >= 2 else 0.0
            want = w.double() * (1 - lr * decay) - lr * g / (g.abs() + 1e-8)
        err = float((after[n].double() - want).abs().max())
        assert err < 2e-5, (n, err)
    assert matrices == 8  # qkv, proj, fc1, fc2 of 2 layers


def _train(rank, world, flags, out):
    from megatronapp.pretrain import build_parser, train

    return train(build_parser().parse_args(FLAGS + flags + ["--output-dir", out]))["losses"]


def test_tp2_dp2_duplicated_equals_one_rank_and_blockwise_trains(tmp_path):
    steps = ["--train-iters", "6"]
    one = run_ranks(_train, 1, steps, str(tmp_path / "one"))[0]
    tp2 = steps + ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated"]
    dup = run_ranks(_train, 4, tp2, str(tmp_path / "dup"))
    zero1 = run_ranks(_train, 4, tp2 + ["--use-distributed-optimizer"], str(tmp_path / "z"))
    for losses in dup + zero1:
        assert max(abs(a - b) for a, b in zip(losses, one, strict=True)) < 1e-5, (losses, one)
    bf16 = run_ranks(_train, 4, tp2 + ["--use-distributed-optimizer", "--bf16"],
                     str(tmp_path / "bf16"))[0]
    assert max(abs(a - b) for a, b in zip(bf16, one, strict=True)) < 3e-2, (bf16, one)
    block = run_ranks(_train, 2, steps + ["--tensor-model-parallel-size", "2"],
                      str(tmp_path / "block"))[0]
    assert block[-1] < block[0] - 0.5 and one[-1] < one[0] - 0.5, (block, one)


def _zero1_pieces(rank, world):
    """Muon inside DistributedOptimizer: this rank's momentum pieces and how
    many of the model's matrices are split between the two ranks."""
    from megatronapp import parallel_state
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, build_run, train_step

    cfg = Config.from_args(build_parser().parse_args(
        FLAGS + ["--use-distributed-optimizer", "--output-dir", "/tmp/o"]))
    run = build_run(cfg)
    try:
        train_step(run, 0)
        opt = run.optimizer
        muon = [s for s in opt.shards() if "momentum_buffer" in s.state]
        split = sum(1 for s in muon if (s.lo, s.hi) != (0, s.param.numel()))
        total = sum(p.numel() for p, g in opt._group_of.items() if g.get("muon"))
        return (type(opt).__name__, type(opt.optimizer).__name__, split,
                sum(s.state["momentum_buffer"].numel() for s in muon), total)
    finally:
        parallel_state.destroy_model_parallel()


def test_zero1_shards_the_momentum():
    res = run_ranks(_zero1_pieces, 2)
    assert all(r[:2] == ("DistributedOptimizer", "Muon") for r in res), res
    total = res[0][4]
    # the two ranks' momentum pieces partition the matrices; one is split between them
    assert sum(r[3] for r in res) == total and all(r[3] < total for r in res), res
    assert any(r[2] for r in res), res


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer", "--bf16"]],
                         ids=["fp32", "zero1-bf16"])
def test_muon_resumes_bit_for_bit(tmp_path, extra):
    common = ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated",
              "--train-iters", "6"] + extra
    ck = str(tmp_path / "ck")
    full = run_ranks(_train, 4, common + ["--save", ck, "--save-interval", "3"],
                     str(tmp_path / "a"))[0]
    again = run_ranks(_train, 4, common + ["--load", ck + "/iter_0000003"],
                      str(tmp_path / "b"))[0]
    assert again == full[3:], (again, full)


def _check(flags):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config

    return lambda: Config.from_args(build_parser().parse_args(FLAGS + flags)).check(2)


def test_what_muon_cannot_run_with_is_refused():
    from megatronapp.memory.plan import estimate
    from megatronapp.pretrain import build_parser

    msgs = error_messages(_check(["--optimizer-impl", "fused"]),
                          _check(["--pipeline-model-parallel-size", "2",
                                  "--forward-backward-disaggregating"]),
                          _check(["--muon-num-ns-steps", "0"]))
    assert "drop --optimizer-impl" in msgs[0]
    assert "--forward-backward-disaggregating" in msgs[1]
    assert "--muon-num-ns-steps" in msgs[2]
    # the memory planner counts Muon's one momentum for the matrices, Adam's two for the rest
    adam = estimate(build_parser().parse_args([f for f in FLAGS if f not in ("--optimizer",
                                                                             "muon")]), 1)
    muon = estimate(build_parser().parse_args(FLAGS), 1)
    assert 0 < adam.optimizer - muon.optimizer < adam.optimizer / 2
