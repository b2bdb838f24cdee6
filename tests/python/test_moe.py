"""Mixture of experts: router, dispatcher, expert parallelism, against an
independent float64 reference written here with plain torch (no dispatcher,
no grouped GEMM, one loop over tokens and experts)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch.nn.functional as F

import torch
from dist_harness import run_ranks

S, B, H, FFN = 8, 2, 16, 32


def moe_cfg(**kw):
    base = dict(num_experts=8, hidden_size=H, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                moe_router_score_function="softmax", moe_router_pre_softmax=False,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=None,
                moe_pad_expert_input_to_capacity=False, moe_token_drop_policy="probs",
                moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3,
                moe_dispatch_compression="none", init_method_std=0.5, sequence_parallel=False)
    base.update(kw)
    return SimpleNamespace(**base)


def reference_moe(x, router_w, experts, cfg):
    """out [T, h] and the aux loss, float64, by definition (Megatron's semantics)."""
    T, E, k = x.shape[0], cfg.num_experts, cfg.moe_router_topk
    logits = x @ router_w.t()
    top, idx = torch.topk(logits, k, dim=-1)
    probs = torch.softmax(top, dim=-1)
    full = torch.softmax(logits, dim=-1)
    load = torch.zeros(E, dtype=x.dtype)
    for e in idx.reshape(-1).tolist():
        load[e] += 1
    aux = cfg.moe_aux_loss_coeff * E * (full.mean(0) * load / (T * k)).sum()
    aux = aux + cfg.moe_z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    keep = torch.ones(T, k, dtype=torch.bool)
    if cfg.moe_expert_capacity_factor is not None:
        cap = math.ceil(T * k / E * cfg.moe_expert_capacity_factor)
        for e in range(E):
            cands = [(float(probs[t, j]), -t, t, j) for t in range(T) for j in range(k)
                     if int(idx[t, j]) == e]
            cands.sort(reverse=True)  # highest weight first; ties: lower token first
            for _, _, t, j in cands[cap:]:
                keep[t, j] = False
    rows = []
    for t in range(T):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(k):
            if keep[t, j]:
                fc1, fc2 = experts[int(idx[t, j])]
                acc = acc + probs[t, j] * (F.gelu(x[t] @ fc1.t(), approximate="tanh") @ fc2.t())
        rows.append(acc)
    return torch.stack(rows), aux, int((~keep).sum())


def _ep_layer(rank, world, ep, cfg_kw, tp=1, etp=None):
    import megatronapp as mapp
    from megatronapp.moe import MoELayer, set_aux_loss_scale

    state = mapp.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                           expert_tensor_parallel_size=etp)
    cfg = moe_cfg(**cfg_kw)
    torch.manual_seed(1234)  # router weights: the same draw on every rank
    layer = MoELayer(cfg, state, output_std=0.3, seed=77)
    set_aux_loss_scale(1.0)
    g = torch.Generator().manual_seed(100 + state.dp_rank)  # tokens differ per data rank
    x = torch.randn(S, B, H, generator=g).requires_grad_()
    c = torch.randn(S, B, H, generator=g)
    out = layer(x)
    (out * c).sum().backward()
    experts = {int(e): (m.fc1.detach().clone(), m.fc2.detach().clone(),
                        m.fc1.grad.clone(), m.fc2.grad.clone())
               for e, m in layer.experts.experts.items()}
    return dict(x=x.detach(), c=c, out=out.detach(), gx=x.grad.clone(),
                router=layer.router.weight.detach().clone(),
                grouter=layer.router.weight.grad.clone(), experts=experts,
                aux=layer.last_aux_loss, dropped=layer.router.last_dropped,
                tp_rank=state.tp_rank, dp_rank=state.dp_rank, etp_rank=state.etp_rank,
                edp_rank=state.edp_rank,
                groups=(state.group_ranks["ep"], state.group_ranks["edp"]))


def _check_against_reference(results, cfg_kw, tp=1):
    """`tp`: the expert-tensor-parallel size (the shards an expert is split in)."""
    cfg = moe_cfg(**cfg_kw)
    router = results[0]["router"].double()
    # Full expert weights: tensor-parallel shards concatenated (fc1 rows, fc2 cols).
    # With edp > 1 (experts replicated) each replica holds its tokens' share
    # of the gradient until the data-parallel reduction: summed here.
    full = {}
    for r in sorted(results, key=lambda r: r["etp_rank"]):
        for e, (fc1, fc2, g1, g2) in r["experts"].items():
            a = full.setdefault(e, {"fc1": {}, "fc2": {}, "g1": {}, "g2": {}})
            i = r["etp_rank"]
            a["fc1"][i], a["fc2"][i] = fc1, fc2
            a["g1"][i] = a["g1"].get(i, 0) + g1
            a["g2"][i] = a["g2"].get(i, 0) + g2
    assert sorted(full) == list(range(cfg.num_experts))
    cat = {e: (torch.cat([v["fc1"][i] for i in range(tp)], 0).double().requires_grad_(),
               torch.cat([v["fc2"][i] for i in range(tp)], 1).double().requires_grad_())
           for e, v in full.items()}
    router_w = router.clone().requires_grad_()
    total = 0.0
    ref_x_grads = {}
    for r in results:
        if r["tp_rank"] != 0 or r["dp_rank"] in ref_x_grads:
            continue
        x = r["x"].double().reshape(S * B, H).requires_grad_()
        out, aux, dropped = reference_moe(x, router_w, cat, cfg)
        torch.testing.assert_close(r["out"].double().reshape(S * B, H), out.detach(),
                                   atol=1e-5, rtol=1e-5)
        assert abs(r["aux"] - float(aux.detach())) < 1e-6
        assert r["dropped"] == dropped
        loss = (out * r["c"].double().reshape(S * B, H)).sum() + aux
        gx, = torch.autograd.grad(loss, x, retain_graph=True)
        ref_x_grads[r["dp_rank"]] = gx
        total = total + loss
    total.backward()
    for r in results:
        torch.testing.assert_close(r["gx"].double().reshape(S * B, H), ref_x_grads[r["dp_rank"]],
                                   atol=1e-5, rtol=1e-5)
    # The router is replicated: the sum of the data ranks' gradients is the reference's.
    g_router = sum(r["grouter"].double() for r in results if r["tp_rank"] == 0)
    torch.testing.assert_close(g_router, router_w.grad, atol=1e-5, rtol=1e-5)
    # Each expert's gradient lives on its owner: the reference's, over every rank's tokens.
    for e, (fc1, fc2) in cat.items():
        g1 = torch.cat([full[e]["g1"][i] for i in range(tp)], 0).double()
        g2 = torch.cat([full[e]["g2"][i] for i in range(tp)], 1).double()
        torch.testing.assert_close(g1, fc1.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g2, fc2.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_matches_reference(ep):
    kw = {}
    results = run_ranks(_ep_layer, ep, ep, kw)
    assert results[0]["groups"][0] == list(range(ep))
    _check_against_reference(results, kw)


def test_expert_and_tensor_parallel_with_capacity_matches_reference():
    kw = {"moe_expert_capacity_factor": 1.0}
    results = run_ranks(_ep_layer, 4, 2, kw, 2)
    assert results[0]["groups"] == ([0, 2], [0])  # ep over the data ranks of one tensor rank
    assert results[0]["dropped"] > 0  # capacity 1.0 with random routing drops some
    _check_against_reference(results, kw, tp=2)


@pytest.mark.parametrize("world,tp,etp,ep", [(2, 2, 1, 2), (2, 2, 1, 1), (4, 4, 2, 2)],
                         ids=["tp2-etp1-ep2", "tp2-etp1-ep1", "tp4-etp2-ep2"])
def test_expert_tensor_parallel_smaller_than_tp_matches_reference(world, tp, etp, ep):
    """--expert-tensor-parallel-size below tp: the tensor ranks split the
    tokens between them and join the expert grid; the numbers stay the
    reference's (one data rank: every tensor rank holds the same x)."""
    kw = {}
    results = run_ranks(_ep_layer, world, ep, kw, tp, etp)
    if (tp, etp, ep) == (2, 1, 2):
        assert results[0]["groups"] == ([0, 1], [0])  # the experts spread over the tensor pair
    if (tp, etp, ep) == (2, 1, 1):
        assert results[0]["groups"] == ([0], [0, 1])  # replicated, each half the tokens
    _check_against_reference(results, kw, tp=etp)


def test_capacity_infinity_equals_dropless_and_padding_changes_nothing():
    import megatronapp  # noqa: F401  (registers the operators)
    from megatronapp.moe import Router, combine, dispatch, plan_stats

    torch.manual_seed(0)
    T, E = 64, 8
    router = Router(H, E, 2)
    x = torch.randn(T, H)
    outs = {}
    # Factor E: each expert may take 2T rows, more than it can ever receive
    # (a token picks an expert at most once): as good as infinite. (1e6 made
    # the padded buffers 8M rows and cost 40 s for the same assertion.)
    for name, factor, pad in (("dropless", None, False), ("huge", float(E), False),
                              ("pad", float(E), True)):
        router.capacity_factor = factor
        assert factor is None or router.capacity(T) >= T
        probs, idx, _ = router(x)
        recv, tpe, plan = dispatch(x, idx, E, capacity=router.capacity(T), pad=pad)
        outs[name] = combine(recv * 3.0, probs, plan)
        if pad:
            assert plan_stats(plan)["rows"] == E * router.capacity(T)
    torch.testing.assert_close(outs["dropless"], outs["huge"], rtol=0, atol=0)
    torch.testing.assert_close(outs["dropless"], outs["pad"], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_token_drops_match_reference_count(policy):
    import megatronapp  # noqa: F401
    from megatronapp.moe import Router, combine, dispatch

    torch.manual_seed(3)
    T, E, k = 50, 4, 2
    router = Router(H, E, k, capacity_factor=0.75, drop_policy=policy)
    router.weight.data[0] += 2.0  # skew: expert 0 overloaded
    x = torch.randn(T, H) + 0.5
    probs, idx, _ = router(x)
    cap = math.ceil(T * k / E * 0.75)
    load = router.last_load.tolist()
    expected = int(sum(max(0, c - cap) for c in load))
    assert expected > 0 and router.last_dropped == expected
    assert int((idx < 0).sum()) == expected
    recv, tpe, plan = dispatch(x, idx, E, capacity=cap)
    assert max(tpe.tolist()) <= cap
    # A dropped assignment contributes nothing; a token dropped by every
    # choice comes out as zeros (the residual carries it in a transformer).
    out = combine(recv, probs, plan)
    for t in range(T):
        want = sum(float(probs[t, j]) * x[t] for j in range(k) if idx[t, j] >= 0)
        torch.testing.assert_close(out[t], want if torch.is_tensor(want) else torch.zeros(H))


def _zero_tokens(rank, world):
    import megatronapp as mapp
    from megatronapp.moe import combine, dispatch

    state = mapp.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    E = 2 * world
    torch.manual_seed(rank)
    # Rank 1 has no tokens at all; every other rank sends only to rank 0's experts,
    # so ranks > 0 receive nothing.
    T = 0 if rank == 1 else 5
    x = torch.randn(T, H, requires_grad=True)
    idx = torch.randint(0, 2, (T, 2)) if T else torch.zeros(0, 2, dtype=torch.long)
    idx[:, 1] = 1 - idx[:, 0] if T else idx[:, 1]
    probs = torch.full((T, 2), 0.5, requires_grad=True)
    recv, tpe, plan = dispatch(x, idx, E, group=state.expert_group)
    y = recv * 2.0
    out = combine(y, probs, plan, group=state.expert_group)
    out.sum().backward()
    return dict(x=x.detach(), out=out.detach(), gx=x.grad, gp=probs.grad,
                received=int(recv.shape[0]), tpe=tpe.tolist())


def test_a_rank_with_zero_tokens_works():
    res = run_ranks(_zero_tokens, 3)
    assert res[0]["received"] == 20  # 5 tokens x 2 choices from each of ranks 0 and 2
    assert res[1]["received"] == 0 and res[2]["received"] == 0
    assert res[1]["out"].shape == (0, H)
    for r in (0, 2):
        torch.testing.assert_close(res[r]["out"], 2.0 * res[r]["x"])  # 0.5 + 0.5 weights
        torch.testing.assert_close(res[r]["gx"], torch.full((5, H), 2.0))
        torch.testing.assert_close(res[r]["gp"], 2.0 * res[r]["x"].sum(1, keepdim=True)
                                   .expand(5, 2))


def _compressed(rank, world):
    import megatronapp as mapp
    from megatronapp.moe import dispatch

    state = mapp.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    torch.manual_seed(rank)
    x = torch.randn(40, 512) * torch.logspace(-2, 1, 40).unsqueeze(1)  # rows of every scale
    idx = torch.stack([torch.arange(40) % 4, (torch.arange(40) + 1) % 4], 1)
    exact, _, _ = dispatch(x, idx, 4, group=state.expert_group)
    q, _, _ = dispatch(x, idx, 4, compression="int8", group=state.expert_group)
    return exact, q


def test_int8_dispatch_error_within_its_bound():
    exact, q = run_ranks(_compressed, 2)[0]
    # One scale per 256 values of a row: |error| <= absmax(block) / 254.
    blocks = exact.reshape(exact.shape[0], -1, 256)
    bound = blocks.abs().amax(-1, keepdim=True) / 254 + 1e-7
    err = (q.reshape_as(blocks) - blocks).abs()
    assert bool((err <= bound).all())
    assert float(err.max()) > 0  # it did compress


def test_bad_inputs_get_clear_errors():
    import megatronapp  # noqa: F401
    from megatronapp.moe import Router, dispatch

    x = torch.randn(4, H)
    with pytest.raises(Exception, match="names expert 9"):
        dispatch(x, torch.tensor([[9, 0]] * 4), 4)
    with pytest.raises(Exception, match="expert_idx must be"):
        dispatch(x, torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="--moe-router-topk 5"):
        Router(H, 4, 5)
    with pytest.raises(Exception, match="element-wise codec"):
        dispatch(x, torch.zeros(4, 2, dtype=torch.long), 4, compression="powersgd:2")


# ---- the MoE GPT through pretrain_gpt.py's training loop ---------------------------------
GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
       "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-iters", "1", "--no-progress",
       "--log-interval", "1000", "--no-watchdog"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


def _train(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(GPT + flags + ["--output-dir", out_dir])
    res = train(args)
    return res["losses"], [h["grad_norm"] for h in res["history"]]


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel",
     "--grad-compression", "int8"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble"],
    ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
     "--num-layers", "4", "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"],
    ["--bf16", "--use-distributed-optimizer", "--moe-layer-freq", "[0,1]"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe", "--memory-pool"],
    ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
     "--num-layers", "4", "--pipeline-schedule", "dynamic"],
], ids=["pp2-zero1", "tp2-sp-int8", "pp2-zb", "interleaved-full-recompute", "bf16-zero1-freq",
        "gpipe-pool", "dynamic"])
def test_expert_parallel_gpt_matches_ep1_step_for_step(tmp_path, layout):
    """The same MoE GPT (experts seeded by global id) at ep 2 and at ep 1:
    expert parallelism changes where experts run, not the numbers."""
    flags = MOE + layout + ["--train-iters", "4"]
    ep1, n1 = run_ranks(_train, 4, flags, str(tmp_path / "a"))[0]
    ep2, n2 = run_ranks(_train, 4, flags + ["--expert-model-parallel-size", "2"],
                        str(tmp_path / "b"))[0]
    assert len(ep1) == len(ep2) == 4
    # int8 codec: bucket boundaries differ; bf16: expert GEMMs see rows from a
    # different number of ranks, so blocking and rounding differ.
    tol = 2e-3 if "int8" in layout else 1e-2 if "--bf16" in layout else 1e-5
    for a, b in zip(ep1, ep2, strict=True):
        assert abs(a - b) <= tol * max(1.0, abs(a)), (ep1, ep2)
    # The gradient norm counts every expert once and the dense weights once.
    for a, b in zip(n1, n2, strict=True):
        assert abs(a - b) <= 10 * tol * max(1.0, abs(a)), (n1, n2)


@pytest.mark.parametrize("sp,ep", [(True, 4), (False, 2)], ids=["sp-ep4", "ep2"])
def test_expert_tensor_parallel_1_under_tp2_matches_etp_equal_tp(tmp_path, sp, ep):
    """DeepSeek-V3's Megatron layout in small: attention split over tp 2, each
    expert whole (--expert-tensor-parallel-size 1) with the tensor ranks in
    the expert grid. Same losses and gradient norms as experts split over tp
    (ZeRO-1: the norm sums every expert shard once)."""
    flags = MOE + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                   "--train-iters", "3"] + (["--sequence-parallel"] if sp else [])
    base, n0 = run_ranks(_train, 4, flags, str(tmp_path / "a"))[0]
    etp1, n1 = run_ranks(_train, 4, flags + ["--expert-tensor-parallel-size", "1",
                                             "--expert-model-parallel-size", str(ep)],
                         str(tmp_path / "b"))[0]
    for a, b in zip(base + n0, etp1 + n1, strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (base, etp1, n0, n1)


def test_moe_checkpoint_resumes_and_reshards_across_ep(tmp_path):
    ck = str(tmp_path / "ck")
    base = MOE + ["--use-distributed-optimizer", "--save", ck]
    full = run_ranks(_train, 4, base + ["--train-iters", "4", "--save-interval", "2",
                                        "--expert-model-parallel-size", "2"],
                     str(tmp_path / "o1"))[0][0]
    for ep in (2, 1, 4):
        resumed = run_ranks(_train, 4, MOE + ["--use-distributed-optimizer", "--load",
                                              str(tmp_path / "ck" / "iter_0000002"),
                                              "--train-iters", "4",
                                              "--expert-model-parallel-size", str(ep)],
                            str(tmp_path / f"r{ep}"))[0][0]
        if ep == 2:
            assert resumed == full[2:], (resumed, full)  # bit-identical
        else:
            assert abs(resumed[0] - full[2]) < 1e-6, (ep, resumed, full)


def test_checkpoint_reshards_across_expert_tensor_parallel_sizes(tmp_path):
    """Saved with whole experts spread over tp x dp (etp 1, ep 4, ZeRO-1
    shards over no one): resumes bit-identically there, and into experts split
    over the tensor pair (etp 2) or one tensor rank (tp 1)."""
    ck = tmp_path / "ck"
    base = MOE + ["--use-distributed-optimizer", "--sequence-parallel"]
    etp1 = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
            "--expert-model-parallel-size", "4"]
    full = run_ranks(_train, 4, base + etp1 + ["--train-iters", "4", "--save-interval", "2",
                                               "--save", str(ck)], str(tmp_path / "o"))[0][0]
    for name, layout in (("same", etp1), ("etp2", ["--tensor-model-parallel-size", "2",
                                                  "--expert-model-parallel-size", "2"]),
                         ("tp1", ["--expert-model-parallel-size", "2"])):
        resumed = run_ranks(_train, 4, base + layout + ["--load", str(ck / "iter_0000002"),
                                                        "--train-iters", "4"],
                            str(tmp_path / name))[0][0]
        if name == "same":
            assert resumed == full[2:], (resumed, full)
        else:
            assert abs(resumed[0] - full[2]) < 1e-6, (name, resumed, full)


def test_moe_gpt_learns_better_than_dense_with_the_same_active_parameters(tmp_path):
    steps = ["--train-iters", "30", "--lr-warmup-iters", "3"]
    # top-2 of 8 experts of hidden 64 = the active MLP of a dense model of hidden 128.
    moe = run_ranks(_train, 4, MOE + steps + ["--expert-model-parallel-size", "4"],
                    str(tmp_path / "m"))[0][0]
    dense = run_ranks(_train, 4, steps + ["--ffn-hidden-size", "128"],
                      str(tmp_path / "d"))[0][0]
    tail = slice(-5, None)
    assert sum(moe[tail]) < sum(dense[tail]), (moe[tail], dense[tail])


def _count(rank, world):
    import megatronapp as mapp
    from megatronapp.models.gpt import GPTConfig, GPTModel

    state = mapp.initialize_model_parallel(1, 1)
    cfg = GPTConfig(vocab_size=128, hidden_size=32, num_layers=3, num_attention_heads=4,
                    seq_length=16, num_experts=4, moe_layer_freq=[0, 1, 1],
                    moe_ffn_hidden_size=48, moe_router_topk=2)
    model = GPTModel(cfg, parallel_state=state)
    return sum(p.numel() for p in model.parameters()), cfg.num_parameters(), \
        cfg.num_parameters(active=True)


def test_parameter_count_of_an_moe_config_is_the_models():
    real, counted, active = run_ranks(_count, 1)[0]
    assert real == counted
    assert active == counted - 2 * (4 - 2) * 2 * 32 * 48  # two MoE layers, 2 idle experts


def _traced_moe(rank, world, flags, out_dir, env):
    os.environ.update(env)
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(flags + ["--output-dir", out_dir, "--trace",
                                              "--trace-dir", out_dir + "/trace"])
    return train(args).get("trace")


@pytest.mark.timeout(600)
def test_detector_names_the_rank_whose_experts_are_overloaded(tmp_path):
    """Expert 0 (on ep rank 0 = rank 0) gets a boost in every token's routing:
    rank 0 computes far more expert rows than its peers, and the detector
    names it, by its expert compute (16 iterations: the detector's t-test over iterations,
    corrected for every (rank, op) it tests, needs more than 6 to reach 1%).
    The dispatcher's exchanges are in the trace with their group and
    sequence number."""
    from megatronapp.trace.aggregate import load_trace
    from megatronapp.trace.detect import detect_dir

    flags = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
             "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", "16", "--eval-iters", "1", "--no-progress", "--log-interval",
             "1000", "--no-watchdog", "--num-experts", "8", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "512", "--expert-model-parallel-size", "4"]
    run_ranks(_traced_moe, 4, flags, str(tmp_path),
              {"MAPP_INJECT_EXPERT_SKEW": "expert=0,boost=20"})
    trace_dir = str(tmp_path / "trace")
    report = detect_dir(trace_dir)
    # Rank 0 is named for its expert compute. The router learns while it runs
    # (the boost pushes tokens, the loss pulls them), so another rank's experts
    # can end up overloaded too; any rank named must be named for that.
    named = {s["rank"]: s["cause"] for s in report["suspects"]}
    assert 0 in named, report["all"]
    assert all(c == "compute (moe_experts)" for c in named.values()), named
    events = load_trace(os.path.join(trace_dir, "trace.rank1.json"))
    moe = [e for e in events if e.get("name") in ("moe_dispatch", "moe_combine")]
    assert moe and all("group" in e["args"] and "seq" in e["args"] for e in moe)


@pytest.mark.parametrize("flags,world,message", [
    (["--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "3"], 4,
     "--expert-tensor-parallel-size 3 must divide --tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
      "--expert-model-parallel-size", "3"], 4,
     r"--expert-model-parallel-size 3 does not divide .*\(2/1\) x data-parallel size 2 = 4"),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
      "--seq-length", "31"], 2, "--seq-length 31 is not divisible by tensor / expert-tensor"),
], ids=["etp-not-dividing-tp", "ep-not-dividing-grid", "sequence-slices"])
def test_bad_expert_tensor_parallel_flags_name_the_fix(flags, world, message):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    with pytest.raises(ConfigError, match=message):
        Config.from_args(build_parser().parse_args(GPT + MOE + flags)).check(world)
