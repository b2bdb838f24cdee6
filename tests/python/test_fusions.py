"""The CPU fused kernels against float64 torch references: scale + causal
mask + softmax (forward, backward, gradcheck) and the counter-based dropout
(drop rate, determinism from the generator, gradient = the same mask); and
the model's local core attention against torch's SDPA."""

import math

import pytest

import torch


def _reference(x, scale):
    q, k = x.shape[-2], x.shape[-1]
    masked = torch.ones(q, k, dtype=torch.bool).triu_(k - q + 1)
    return torch.softmax((x.double() * scale).masked_fill(masked, float("-inf")), -1)


@pytest.mark.parametrize("shape", [(2, 3, 17, 17), (5, 8, 8), (2, 4, 24)])
def test_scaled_causal_softmax_matches_float64(shape):
    from megatronapp.models.fusions import scaled_causal_softmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3
    scale = 1 / math.sqrt(32)
    x32 = x.clone().requires_grad_()
    y = scaled_causal_softmax(x32, scale)
    xd = x.double().requires_grad_()
    want = _reference(xd, scale)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-7)
    dy = torch.randn(*shape, generator=g)
    y.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(x32.grad.double(), xd.grad, rtol=1e-5, atol=1e-7)
    assert torch.autograd.gradcheck(lambda t: scaled_causal_softmax(t, scale),
                                    (x[..., :5, :7].double().contiguous().requires_grad_(),))
    yb = scaled_causal_softmax(x.bfloat16(), scale)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), _reference(x.bfloat16(), scale), rtol=1e-2,
                               atol=1e-2)
    with pytest.raises(ValueError, match="queries <= keys"):
        scaled_causal_softmax(torch.zeros(4, 3), 1.0)


def test_the_cuda_composite_path_matches_the_kernel():
    """What runs on CUDA (torch ops) against the CPU kernel, on CPU tensors."""
    from megatronapp.models.fusions import _composite, _composite_backward

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 9, 12, generator=g, dtype=torch.float64)
    y = torch.ops.mapp.scaled_causal_softmax(x, 0.3)
    torch.testing.assert_close(_composite(x, 0.3), y, rtol=1e-12, atol=1e-14)
    dy = torch.randn(2, 3, 9, 12, generator=g, dtype=torch.float64)
    torch.testing.assert_close(_composite_backward(y, dy, 0.3),
                               torch.ops.mapp.scaled_causal_softmax_backward(dy, y, 0.3),
                               rtol=1e-12, atol=1e-14)


def test_fused_dropout_rate_determinism_and_gradient():
    from megatronapp.tensor_parallel.random import dropout

    x = torch.randn(1 << 20, dtype=torch.float64) + 5.0
    torch.manual_seed(1)
    y = dropout(x, 0.25)
    kept = y != 0
    n = x.numel()
    assert abs(kept.double().mean().item() - 0.75) < 6 * math.sqrt(0.75 * 0.25 / n)
    scale = 65536 / (65536 - round(0.25 * 65536))
    torch.testing.assert_close(y[kept], x[kept] * scale, rtol=0, atol=0)
    torch.manual_seed(1)
    assert torch.equal(dropout(x, 0.25), y)  # the generator decides the mask
    xr = x[:1000].clone().requires_grad_()
    torch.manual_seed(2)
    out = dropout(xr, 0.5)
    out.backward(torch.ones_like(out))
    assert torch.equal(xr.grad != 0, out != 0)  # the gradient sees the same mask
    assert dropout(x, 0.25, training=False) is x
    for dtype in (torch.float32, torch.bfloat16):
        yd = dropout(x.to(dtype), 0.1)
        assert yd.dtype == dtype and abs((yd == 0).double().mean().item() - 0.1) < 0.01
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        dropout(x, 1.0)


def _local_vs_sdpa(rank, world):
    import megatronapp as mapp
    from megatronapp.models.gpt import GPTConfig, ParallelAttention

    state = mapp.initialize_model_parallel()
    cfg = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, seq_length=16)
    torch.manual_seed(0)
    a = ParallelAttention(GPTConfig(**cfg, attention_backend="local"), state, 0.02).double()
    torch.manual_seed(0)
    b = ParallelAttention(GPTConfig(**cfg, attention_backend="flash"), state, 0.02).double()
    x = torch.randn(16, 2, 32, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-10, atol=1e-12)
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)


def test_local_attention_is_sdpa():
    """The model's local core attention (fused softmax kernel) and torch's
    SDPA compute the same attention, forward and backward."""
    from dist_harness import run_ranks

    run_ranks(_local_vs_sdpa, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_dropout_kernel_is_the_composition(dtype):
    """One kernel, the same numbers as softmax then dropout from the same
    generator state, forward and backward (the mask follows the flat index)."""
    from megatronapp.models.fusions import scaled_causal_softmax, scaled_causal_softmax_dropout
    from megatronapp.tensor_parallel.random import dropout

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, 16, generator=g, dtype=dtype)
    dy = torch.randn(2, 3, 16, 16, generator=g, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(9)
    a = scaled_causal_softmax_dropout(xa, 0.25, 0.3)
    torch.manual_seed(9)
    b = dropout(scaled_causal_softmax(xb, 0.25), 0.3)
    assert torch.equal(a, b)
    a.backward(dy)
    b.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-6 if dtype == torch.float32 else 1e-12,
                               atol=1e-7 if dtype == torch.float32 else 1e-15)


def test_kernels_reject_shapes_they_cannot_take():
    for bad in (torch.zeros(2, 0, 0), torch.zeros(3, 4, 2)):
        with pytest.raises(Exception, match="no more queries than keys"):
            torch.ops.mapp.scaled_causal_softmax(bad, 1.0)
    with pytest.raises(Exception, match=r"\[0, 1\)"):
        torch.ops.mapp.fused_dropout(torch.ones(4), 1.5, 0)
