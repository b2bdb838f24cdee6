"""Cross-entropy over vocabulary-sharded logits.

One fused pass per rank (``torch.ops.mapp.vocab_ce_local_stats``, C++ on CPU,
a CUDA kernel on GPU) reduces each row of the local shard to three numbers
(max, sum of exp(x - max), target logit or 0); a single all-gather of those
3 floats per token lets every rank finish the loss. Megatron-LM uses three
all-reduces for the same (max, target logit, sum-exp). The backward recomputes
softmax from the saved logits and the per-row log-sum-exp. The autograd
function is C++ (``mapp::nn::vocab_parallel_cross_entropy``, which the C++
trainers call too), reached as ``torch.ops.mapp.vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

from .. import _C  # noqa: F401  (registers torch.ops.mapp)
from ..parallel_state import get_parallel_state


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
    ``ignore_index`` get loss 0 and no gradient. A target id outside the
    vocabulary is an IndexError (on CPU; an asynchronous device assertion on
    GPUs); a target shape that is not the logits' rows, a ValueError."""
    if group is None:
        group = get_parallel_state().tensor_group
    return torch.ops.mapp.vocab_parallel_cross_entropy(logits, target, group.group_name,
                                                       ignore_index)
