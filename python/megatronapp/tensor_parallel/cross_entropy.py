"""Cross-entropy over vocabulary-sharded logits.

One fused pass per rank (``torch.ops.mapp.vocab_ce_local_stats``, C++ on CPU,
a CUDA kernel on GPU) reduces each row of the local shard to three numbers
(max, sum of exp(x - max), target logit or 0); a single all-gather of those
3 floats per token lets every rank finish the loss. Megatron-LM uses three
all-reduces for the same (max, target logit, sum-exp). The backward recomputes
softmax from the saved logits and the per-row log-sum-exp.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

from .. import _collectives
from ..parallel_state import get_parallel_state


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        world, rank = group.size(), group.rank()
        vocab_local = logits.size(-1)
        vocab_start = rank * vocab_local
        vocab = vocab_local * world
        ignored = target == ignore_index
        bad = (~ignored) & ((target < 0) | (target >= vocab))
        msg = (f"vocab_parallel_cross_entropy: target ids must lie in [0, {vocab}) "
               f"(or equal ignore_index={ignore_index})")
        if target.device.type != "cpu":  # no host synchronization per microbatch
            torch._assert_async(~bad.any(), msg)  # noqa: SLF001
        elif bool(bad.any()):
            raise IndexError(f"{msg}; found {target[bad].flatten()[:4].tolist()}")
        stats = torch.ops.mapp.vocab_ce_local_stats(logits, target, vocab_start)
        if world > 1:
            stats = _collectives.all_gather(stats.unsqueeze(0), 0, group)
        else:
            stats = stats.unsqueeze(0)
        m, s, t = stats.unbind(-1)  # each [world, *rows]
        row_max = m.max(dim=0).values
        lse = row_max + torch.log((s * torch.exp(m - row_max)).sum(dim=0))
        loss = (lse - t.sum(dim=0)).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, target, lse, ignored)
        ctx.vocab_start = vocab_start
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse, ignored = ctx.saved_tensors
        grad = torch.exp(logits.float() - lse.unsqueeze(-1))  # softmax of the shard
        local = target - ctx.vocab_start
        inside = (local >= 0) & (local < logits.size(-1)) & ~ignored
        one_hot = torch.zeros_like(grad)
        one_hot.scatter_(-1, local.clamp(0, logits.size(-1) - 1).unsqueeze(-1),
                         inside.unsqueeze(-1).to(grad.dtype))
        grad = (grad - one_hot) * grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(logits.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token loss ``F.cross_entropy(full_logits, target, reduction='none')``
    for logits sharded on the last dim: ``logits`` [..., V/tp], ``target`` [...]
    global vocabulary ids. Returns float32 [...]; tokens equal to
    ``ignore_index`` get loss 0 and no gradient."""
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal "
            f"logits shape without the vocabulary dim {tuple(logits.shape[:-1])}")
    if group is None:
        group = get_parallel_state().tensor_group
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
