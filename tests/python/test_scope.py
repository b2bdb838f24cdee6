"""MegaScope's Python API: captured internals against an independent
computation, tensor-parallel invariance (TP2 == TP1) of what is captured and
of seeded perturbations, each perturbation kind's effect, recomputation,
and clear errors for bad requests."""

from __future__ import annotations

import math

import pytest

import torch
from dist_harness import run_ranks

SHAPE = dict(vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=32)


def _model(tp_ranks=1, **kw):
    import megatronapp
    from megatronapp.models import GPTConfig, GPTModel

    state = megatronapp.initialize_model_parallel(tensor_model_parallel_size=tp_ranks)
    return GPTModel(GPTConfig(**{**SHAPE, **kw}), parallel_state=state, seed=5).eval(), state


def _ids():
    return torch.tensor([[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33]])


def _capture_and_perturb(rank, world, sp=False):
    from megatronapp.scope import Scope
    from megatronapp.scope.session import generate

    model, state = _model(world, sequence_parallel=sp)
    sc = Scope(model, state)
    sc.watch("attn_probs", reduce="none")
    sc.watch("qkv", reduce="bins", bins=4)
    sc.watch("residual", reduce="none")
    sc.watch("mlp_out", reduce="mean")
    sc.watch("logits", reduce="topk", k=3)
    with torch.no_grad():
        with sc.step():
            model(_ids())
        clean = sc.collect()
        sc.perturb("mlp_out", "gaussian", layers=[0], std=0.3, seed=11)
        sc.perturb("attn_probs", "zero_head", layers=[1], head=3, steps=2)
        with sc.step():
            model(_ids())
        noisy = sc.collect()
        sc.perturb("weights", "uniform", name="layers.1.mlp.fc1.weight", scale=0.5, seed=2)
        with sc.step():
            model(_ids())
        weights = sc.collect()
        with sc.step():  # every perturbation has expired
            model(_ids())
        after = sc.collect()
        gen = None if sp else generate(model, sc, [_ids()[0].tolist()], 3)
    return {"clean": clean, "noisy": noisy, "weights": weights, "after": after,
            "log": sc.log, "gen": gen} if rank == 0 else None


def _close(a, b, tol=1e-5):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k], tol)
    elif torch.is_tensor(a):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        else:
            assert torch.equal(a, b)
    else:
        assert a == b, (a, b)


@pytest.fixture(scope="module")
def tp1():
    return run_ranks(_capture_and_perturb, 1)[0]


def _reference(rank, world):
    """Layer 0's attention and the logits by hand, in float64."""
    m, _ = _model(1)
    m = m.double()
    ids = _ids()
    with torch.no_grad():
        x = m.word_embeddings.weight[ids[0]] + m.position_embeddings.weight[:ids.shape[1]]
        layer = m.layers[0]
        h = torch.nn.functional.layer_norm(x, (32,), layer.ln1.weight, layer.ln1.bias, 1e-5)
        qkv = (h @ layer.attn.qkv.weight.T + layer.attn.qkv.bias).view(-1, 4, 3, 8)
        q, k = qkv[:, :, 0].transpose(0, 1), qkv[:, :, 1].transpose(0, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
        logits = m(ids)[0]
    return probs, q, logits


def test_captured_internals_match_an_independent_computation(tp1):
    """Attention probabilities, binned queries and the top logits against
    plain torch ops in float64."""
    probs, q, logits = run_ranks(_reference, 1)[0]
    clean = tp1["clean"]
    assert clean["attn_probs"][0].shape == (4, 12, 12)
    torch.testing.assert_close(clean["attn_probs"][0].double(), probs, atol=1e-5, rtol=1e-5)
    assert clean["query"][0].shape == (4, 12, 4)  # 8 head dims in 4 bins
    torch.testing.assert_close(clean["query"][0].double(), q.reshape(4, 12, 4, 2).mean(-1),
                               atol=1e-5, rtol=1e-5)
    top = clean["logits"][2]
    torch.testing.assert_close(top["values"].double(), logits.topk(3, -1).values,
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(top["indices"], logits.topk(3, -1).indices)
    assert clean["residual"][1].shape == (12, 32)
    assert clean["mlp_out"][0].shape == (12,)


def test_tp2_captures_and_perturbs_exactly_as_tp1(tp1):
    tp2 = run_ranks(_capture_and_perturb, 2)[0]
    for key in ("clean", "noisy", "weights", "after"):
        _close(tp1[key], tp2[key], 1e-5)
    assert tp1["gen"]["tokens"] == tp2["gen"]["tokens"]
    _close(tp1["gen"]["internals"], tp2["gen"]["internals"], 1e-5)


def test_tp2_with_sequence_parallelism_captures_the_same(tp1):
    tp2 = run_ranks(_capture_and_perturb, 2, True)[0]
    for key in ("clean", "noisy", "after"):
        _close(tp1[key], tp2[key], 1e-5)


def test_each_perturbation_changes_what_it_should_and_expires(tp1):
    clean, noisy, w, after = tp1["clean"], tp1["noisy"], tp1["weights"], tp1["after"]
    # zero_head on layer 1, head 3: that head's probabilities are 0, others untouched
    assert noisy["attn_probs"][1][3].abs().max() == 0
    # layer 0's attention comes before the MLP noise: identical
    _close(noisy["attn_probs"][0], clean["attn_probs"][0])
    # the noise reached the residual stream of layer 0
    assert (noisy["residual"][0] - clean["residual"][0]).abs().max() > 0.05
    # the weights step changes layer 1's MLP output, not layer 0's
    _close(w["mlp_out"][0], clean["mlp_out"][0])
    assert (w["mlp_out"][1] - clean["mlp_out"][1]).abs().max() > 1e-4  # means over hidden
    # zero_head armed for 2 steps, weights for 1: all expired, weights restored
    _close(after, clean)
    steps = [e["step"] for e in tp1["log"]]
    assert steps[:2] == [1, 2], tp1["log"]
    assert "zero_head" in tp1["log"][1]["perturbation"] and "weights" in tp1["log"][1]["perturbation"]


def _bitflip(rank, world):
    from megatronapp.scope import Scope

    model, state = _model(world)
    sc = Scope(model, state)
    sc.watch("mlp_out", reduce="none", layers=[0])
    with torch.no_grad():
        with sc.step():
            model(_ids())
        clean = sc.collect()
        sc.perturb("mlp_out", "bitflip", layers=[0], bit=31, fraction=0.25, seed=4)
        with sc.step():
            model(_ids())
        flipped = sc.collect()
    return (clean, flipped) if rank == 0 else None


def test_bitflip_flips_the_sign_bit_of_the_chosen_fraction():
    clean, flipped = run_ranks(_bitflip, 1)[0]
    a, b = clean["mlp_out"][0], flipped["mlp_out"][0]
    changed = a != b
    assert torch.equal(b[changed], -a[changed])  # bit 31 of fp32 is the sign
    assert 0.15 < changed.float().mean() < 0.35


def _recompute(rank, world):
    """Training steps with full recomputation: the record is taken once (not
    again by the recompute) and the noise is the same in the recompute."""
    import megatronapp
    from megatronapp.scope import Scope

    out = {}
    for gran in (None, "full"):
        torch.manual_seed(0)
        kw = {} if gran is None else dict(recompute_granularity="full",
                                           recompute_method="uniform", recompute_num_layers=1)
        model, state = _model(world, **kw)
        model.train()
        sc = Scope(model, state)
        sc.watch("residual", reduce="none")
        sc.perturb("mlp_out", "gaussian", layers=[1], std=0.2, seed=9)
        with sc.step():
            loss = model(_ids(), _ids()).mean()
            loss.backward()
        out[gran] = (loss.item(), sc.collect(), model.layers[0].mlp.fc1.weight.grad.clone())
        megatronapp.destroy_model_parallel()
    return out if rank == 0 else None


def test_recomputation_records_once_and_reapplies_the_same_noise():
    out = run_ranks(_recompute, 2)[0]
    (l0, r0, g0), (l1, r1, g1) = out[None], out["full"]
    assert l0 == l1
    _close(r0, r1, 0)
    torch.testing.assert_close(g0, g1, atol=1e-6, rtol=1e-6)


def _errors(rank, world):
    from megatronapp.scope import Scope, ScopeError

    model, state = _model(world)
    sc = Scope(model, state)
    msgs = []
    for call in (lambda: sc.watch("nope"), lambda: sc.watch("residual", layers=[7]),
                 lambda: sc.watch("residual", reduce="eval"),
                 lambda: sc.watch("attn_probs", reduce="mean", dim=0),
                 lambda: sc.perturb("mlp_out", "zero_head"),
                 lambda: sc.perturb("weights", "gaussian", name="nope.weight"),
                 lambda: sc.perturb("residual", "gaussian", std=-1),
                 lambda: sc.perturb("attn_probs", "zero_head", head=4)):
        with pytest.raises(ScopeError) as e:
            call()
        msgs.append(str(e.value))
    return msgs


def test_bad_requests_get_clear_errors():
    msgs = run_ranks(_errors, 1)[0]
    assert "unknown site 'nope'" in msgs[0] and "attn_probs" in msgs[0]
    assert "layer must be an integer in [0, 1]" in msgs[1]
    assert "unknown reducer 'eval'" in msgs[2]
    assert "head axis" in msgs[3]
    assert "zero_head needs a site with heads" in msgs[4]
    assert "unknown parameter 'nope.weight'" in msgs[5]
    assert "std must be a number >= 0" in msgs[6]
    assert "head must be an integer in [0, 3]" in msgs[7]
