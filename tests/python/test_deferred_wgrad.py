"""megatronapp.autograd: the deferred weight gradients of zero-bubble
schedules, kept by the C++ engine (``mapp::nn``) and bound for Python.

Checked against float64 autograd of plain ``F.linear``: the deferrable linear
returns the same output and gradients, defers dW (and only dW) inside a
``deferring`` backward, and ``run`` accumulates it through autograd so that
post-accumulate hooks fire once the gradient is really there."""

from __future__ import annotations

import gc

import pytest
import torch.nn.functional as F

import torch
from megatronapp import autograd


def _case(bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=g)
    w = torch.randn(6, 8, dtype=torch.float64, generator=g)
    b = torch.randn(6, dtype=torch.float64, generator=g) if bias else None
    gy = torch.randn(3, 5, 6, dtype=torch.float64, generator=g)
    return x, w, b, gy


def _reference(x, w, b, gy):
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = F.linear(*leaves)
    y.backward(gy)
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_deferred_weight_gradient_matches_autograd(bias):
    x, w, b, gy = _case(bias)
    want_y, want = _reference(x, w, b, gy)
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    ready = []
    leaves[1].register_post_accumulate_grad_hook(
        lambda p: ready.append((autograd.is_deferred(p), p.grad is not None)))
    y = autograd.linear(*leaves)
    assert torch.equal(y.detach(), want_y)
    store = autograd.WeightGradStore()
    with autograd.deferring(store):
        y.backward(gy)
        # BI: the input (and bias) gradients now, the weight's put aside
        assert len(store) == 1 and autograd.is_deferred(leaves[1])
        assert not autograd.is_deferred(leaves[0])
    assert leaves[1].grad is None and not autograd.is_deferred(leaves[1])
    assert torch.equal(leaves[0].grad, want[0])
    if bias:
        assert torch.equal(leaves[2].grad, want[2])
    autograd.run(store)  # W: accumulated through autograd, hooks fire
    assert len(store) == 0
    assert torch.allclose(leaves[1].grad, want[1], rtol=0, atol=1e-12)
    assert ready == [(True, False), (False, True)]


def test_without_deferring_the_weight_gradient_is_computed_at_once():
    x, w, b, gy = _case()
    _, want = _reference(x, w, b, gy)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    autograd.linear(*leaves).backward(gy)
    for got, ref in zip((t.grad for t in leaves), want, strict=True):
        assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    with torch.no_grad():  # no graph: a plain linear
        assert not autograd.linear(*leaves).requires_grad


def test_python_closures_join_the_engine_store():
    """A custom autograd function defers its own dW (as the TP and FP8
    linears do): the closure is kept by the C++ store, run without the GIL
    held by the caller, and its errors surface as Python exceptions."""
    w = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    assert autograd.defer(w, lambda: torch.ones(4)) is False  # no active store
    store = autograd.WeightGradStore()
    with autograd.deferring(store):
        assert autograd.defer(w, lambda: torch.full((4,), 2.0, dtype=torch.float64))
        inner = autograd.WeightGradStore()
        with autograd.deferring(inner):  # nested: the inner store is active
            assert not autograd.is_deferred(w)
        assert autograd.is_deferred(w)
    autograd.run(store)
    assert torch.equal(w.grad, torch.full((4,), 2.0, dtype=torch.float64))

    bad = autograd.WeightGradStore()
    with autograd.deferring(bad):
        autograd.defer(w, lambda: (_ for _ in ()).throw(ValueError("closure failed")))
    with pytest.raises(ValueError, match="closure failed"):
        autograd.run(bad)

    dropped = autograd.WeightGradStore()  # a store never run frees its closures
    with autograd.deferring(dropped):
        autograd.defer(w, lambda: torch.ones(4))
    del dropped
    gc.collect()
