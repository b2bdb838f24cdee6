"""Deferred weight gradients: the real input-gradient / weight-gradient split.

Owned by the layers (``tensor_parallel``, ``models``), used by the pipeline
executor (BI / W actions) and by data-parallel hooks (:func:`is_deferred`).

Zero-bubble schedules run a microbatch's backward in two actions: BI computes
the gradient of the stage's input (what the previous stage waits for) and W,
later, the weight gradients. Linear layers route through :func:`linear`
(``torch.ops.mapp.deferrable_linear``, a C++ autograd function), whose
backward always returns the input gradient and, while a :func:`deferring`
context is active, stores a closure for its weight gradient instead of
computing it. :func:`run` evaluates the stored closures and accumulates them
through autograd (so post-accumulate hooks, e.g. DDP's, fire as usual).
Parameters without a deferrable layer (LayerNorm, embeddings, biases) get
their gradients in BI; the matmul weight gradients — about half of the
backward FLOPs — move to W.

The store, the active store and the deferral are the C++ engine's
(``mapp::nn`` in ``src/torch/nn.cc``; C++ trainers use the same): this module
binds them. The active store is process-wide rather than thread-local on
purpose: autograd runs CUDA backward functions on its own device threads.
"""

from __future__ import annotations

import contextlib

import torch

from . import _C

__all__ = ["linear", "deferring", "defer", "is_deferred", "run", "WeightGradStore",
           "weight_and_bias_grads"]

#: The closures of deferred weight gradients of one backward pass (``len``:
#: how many); filled inside :func:`deferring`, emptied by :func:`run`.
WeightGradStore = _C.WeightGradStore

_ACTIVE: WeightGradStore | None = None  # keeps the engine's active store alive


@contextlib.contextmanager
def deferring(store: WeightGradStore):
    """Inside, deferrable layers put their weight gradients into `store`."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, store
    _C.set_active_weight_grad_store(store)
    try:
        yield store
    finally:
        _ACTIVE = previous
        _C.set_active_weight_grad_store(previous)


def defer(param: torch.Tensor, wgrad) -> bool:
    """Inside a :func:`deferring` backward: stores ``wgrad`` (a closure that
    returns `param`'s gradient) for :func:`run` and returns True; outside one
    returns False and the caller computes the gradient now. This is the hook
    for custom autograd functions that want their weight gradient split off."""
    return _C.defer_weight_grad(param, wgrad)


def is_deferred(param: torch.Tensor) -> bool:
    """True inside a deferring backward for a parameter whose gradient was put
    aside. Autograd still runs post-accumulate hooks of such a parameter (with
    no gradient), so hooks that mark gradients ready must check this."""
    return _C.is_weight_grad_deferred(param)


def run(store: WeightGradStore) -> None:
    """Computes the stored weight gradients and accumulates them into ``.grad``
    through autograd (hooks run). Empties the store."""
    _C.run_weight_grads(store)


def weight_and_bias_grads(ctx, dy: torch.Tensor, inputs, weight: torch.Tensor) -> tuple:
    """(dW, db) of ``y = x W^T + b`` for a custom linear's backward whose
    arguments 1 and 2 are the weight and the bias: dW is deferred inside a
    :func:`deferring` backward (then None here), db computed now. `inputs`
    returns x (called only when dW is needed, e.g. to gather it). dW is the
    engine's (``mapp::nn::linear_weight_grad``, as :func:`linear`'s): None
    when the GEMM added it into the weight's gradient bucket in place
    (gradient-accumulation fusion)."""
    dw = db = None
    if ctx.needs_input_grad[1]:
        x = inputs()
        may_fuse = not torch.is_grad_enabled()  # (a double backward keeps its graph)

        def wgrad(dy=dy, x=x):
            return _C.linear_weight_grad(weight, dy, x, may_fuse)
        if not defer(weight, wgrad):
            dw = wgrad()
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = dy.reshape(-1, dy.shape[-1]).sum(0)
    return dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose weight gradient can be deferred (see module docstring);
    FP8 (:mod:`megatronapp.fp8`) for a weight marked by ``fp8.enable``."""
    meta = getattr(weight, "fp8_meta", None)
    if meta is not None:
        return meta.linear(x, weight, bias)
    return torch.ops.mapp.deferrable_linear(x, weight, bias)
