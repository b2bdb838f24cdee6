"""The one place where a step's gradients are finished.

After the last backward of a step, :func:`finish_gradients` does, in order:

1. **data-parallel reduction** — waits for megatronapp DDP's overlapped
   (possibly compressed) reductions; a chunk not wrapped in DDP is averaged
   over the data-parallel group here (SUM, then divide: Gloo's AVG has a
   known silent bug);
2. **sequence-parallel sums** — parameters replicated over the tensor group
   but fed only their sequence shard (LayerNorms, row-parallel biases under
   SP) hold partial sums: summed over the tensor group;
3. **tied embeddings** — with the word embeddings on the first and the last
   pipeline stage, their gradients are summed over the embedding group
   (zb-v's wave puts both on stage 0: summed there); steps 2 and 3 are the
   C++ engine's ``torch.ops.mapp.finish_grad_sums_``, this module picks the
   gradients;
4. **one global norm** (one host synchronization) and **clipping**.

Full gradients (``param.grad``), float32 main gradients (a
:class:`~megatronapp.optimizer.MixedPrecisionOptimizer`) and ZeRO-1 shards
(the fp32 slice of each parameter a
:class:`~megatronapp.optimizer.DistributedOptimizer` rank owns) take the same
path: all are lists of ``(param, grad)`` pairs, and every sum
above is element-wise, so a shard is summed exactly like the full tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import _collectives
from ..optimizer import MixedPrecisionOptimizer
from ..optimizer import clip_grads as gradients
from ..parallel_state import ParallelState, resolve_state
from ..pipeline import GradSync

__all__ = ["finalize_model_grads", "finish_gradients", "clip_grad_norm_"]


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


@torch.no_grad()
def finalize_model_grads(model, parallel_state: ParallelState | None = None, *,
                         optimizer=None) -> list:
    """Steps 1-3 above for `model` (a module or the list of this rank's
    pipeline chunks). With a :class:`DistributedOptimizer` the sums run on its
    shards. Returns the finished ``(param, grad)`` pairs. Call it once per
    step, after the last backward."""
    state = resolve_state(parallel_state)
    chunks = _chunks(model)
    for chunk in chunks:
        if isinstance(chunk, GradSync):
            chunk.finish_grad_sync()
        elif state.dp_size * state.cp_size > 1:
            dense, experts = [], []
            for p in chunk.parameters():
                if p.grad is not None:
                    (experts if getattr(p, "expert_parallel", False) else dense).append(p.grad)
            # replicas: the data (x context) ranks
            group = state.data_context_group or state.data_group
            _collectives.coalesced_all_reduce_(dense, group, scale=1.0 / group.size())
            if experts:  # summed over ep by the dispatcher; over edp here: 1/(dp cp) in all
                _collectives.coalesced_all_reduce_(experts, state.expert_data_group_or_data(),
                                                   scale=1.0 / (state.dp_size * state.cp_size))
    if isinstance(optimizer, MixedPrecisionOptimizer):  # fp32 main gradients (ZeRO: shards)
        pairs = optimizer.grad_shards()
    else:
        pairs = [(p, p.grad) for c in chunks for p in c.parameters() if p.grad is not None]
    # Steps 2-3, the C++ engine's (mapp::finish_grad_sums_, which C++ trainers call too).
    sp = ([g for p, g in pairs if getattr(p, "sequence_parallel", False)]
          if state.tp_size > 1 else [])
    shared = ([g for p, g in pairs if getattr(p, "shared_embedding", False)]
              if state.pp_size > 1 and state.embedding_group is not None else [])
    torch.ops.mapp.finish_grad_sums_(sp, state.tensor_group.group_name if sp else "",
                                     shared, state.embedding_group.group_name if shared else "")
    return pairs


@torch.no_grad()
def finish_gradients(model, optimizer, parallel_state: ParallelState | None = None,
                     max_norm: float = 0.0) -> float:
    """Steps 1-4: finishes the gradients of `model` for `optimizer`, clips them
    to `max_norm` (0: no clipping) and returns the global norm before clipping."""
    state = resolve_state(parallel_state)
    pairs = finalize_model_grads(model, state, optimizer=optimizer)
    if isinstance(optimizer, MixedPrecisionOptimizer):  # ZeRO shards: summed over dp too
        return optimizer.clip_grad_norm_(max_norm)
    return gradients.clip_grad_norm_(pairs, max_norm, state, [state.model_group],
                                     expert_groups=state.expert_norm_groups())


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    parallel_state: ParallelState | None = None) -> float:
    """Scales full gradients so that their global L2 norm over the model-parallel
    group is at most `max_norm`; returns the norm before clipping."""
    state = resolve_state(parallel_state)
    pairs = [(p, p.grad) for p in parameters if p.grad is not None]
    return gradients.clip_grad_norm_(pairs, max_norm, state, [state.model_group],
                                     expert_groups=state.expert_norm_groups())
