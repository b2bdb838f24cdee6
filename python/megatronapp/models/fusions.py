"""Fused kernels of the model's elementwise chains (Megatron's
``core.fusions``): scale + causal mask + softmax of core attention.

On CPU they run megatronapp's C++ kernels (``torch.ops.mapp.*``); elsewhere
the same function composed of torch ops (a CUDA kernel is future work; the
composite is what Megatron runs without its fused kernels)."""

from __future__ import annotations

import torch

__all__ = ["scaled_causal_softmax", "scaled_causal_softmax_dropout"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 at least (half-precision scores are promoted)."""
    return torch.promote_types(x.dtype, torch.float32)


def _composite(x: torch.Tensor, scale: float) -> torch.Tensor:
    q_len, k_len = x.shape[-2], x.shape[-1]
    masked = torch.ones(q_len, k_len, dtype=torch.bool, device=x.device).triu_(k_len - q_len + 1)
    scores = (x.to(_compute_dtype(x)) * scale).masked_fill_(masked, float("-inf"))
    return torch.softmax(scores, dim=-1).to(x.dtype)


def _composite_backward(y: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    yf, gf = y.to(_compute_dtype(y)), grad.to(_compute_dtype(y))
    return (scale * yf * (gf - (gf * yf).sum(-1, keepdim=True))).to(y.dtype)


class _ScaledCausalSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        if x.device.type == "cpu":
            y = torch.ops.mapp.scaled_causal_softmax(x, scale)
        else:
            y = _composite(x, scale)
        ctx.scale = scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        if y.device.type == "cpu":
            return torch.ops.mapp.scaled_causal_softmax_backward(grad, y, ctx.scale), None
        return _composite_backward(y, grad, ctx.scale), None


def scaled_causal_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(scale * x)`` over the last dim with key positions after each
    query masked (causal; queries aligned to the last keys), for scores
    ``[..., queries, keys]``; computed in float32 at least, returned in x's
    dtype. Keeps only its output for backward."""
    _check_scores(x, "scaled_causal_softmax")
    return _ScaledCausalSoftmax.apply(x, float(scale))


def _check_scores(x: torch.Tensor, what: str) -> None:
    if x.dim() < 2 or x.shape[-2] > x.shape[-1]:
        raise ValueError(f"{what}: expected [..., queries, keys] scores with queries <= keys, "
                         f"got {tuple(x.shape)}")


class _ScaledCausalSoftmaxDropout(torch.autograd.Function):
    """CPU float/double: softmax and dropout of the probabilities in one
    kernel per (batch, head) block; keeps the probabilities (for the softmax
    backward), regenerates the mask from the seed."""

    @staticmethod
    def forward(ctx, x, scale, p, seed):
        y, out = torch.ops.mapp.scaled_causal_softmax_dropout(x, scale, p, seed)
        ctx.scale, ctx.p, ctx.seed = scale, p, seed
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        dx = torch.ops.mapp.scaled_causal_softmax_dropout_backward(
            grad, y, ctx.scale, ctx.p, ctx.seed)
        return dx, None, None, None


def scaled_causal_softmax_dropout(x: torch.Tensor, scale: float, p: float,
                                  training: bool = True) -> torch.Tensor:
    """``dropout(scaled_causal_softmax(x, scale), p)`` (dropout as
    :func:`megatronapp.tensor_parallel.random.dropout`: one seed drawn from
    the current generator, the same result element for element). On CPU in
    float32/64 one fused kernel; otherwise the two ops."""
    from ..tensor_parallel.random import check_dropout_probability, draw_seed, dropout

    if not training or p == 0.0 or x.device.type != "cpu" or x.dtype not in (
            torch.float32, torch.float64):
        return dropout(scaled_causal_softmax(x, scale), p, training)
    check_dropout_probability(p)
    _check_scores(x, "scaled_causal_softmax_dropout")
    return _ScaledCausalSoftmaxDropout.apply(x, float(scale), float(p), draw_seed())
