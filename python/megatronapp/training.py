"""Pieces of a Megatron-style training step that need the topology.

* :func:`finalize_model_grads` — after the last microbatch's backward: sums the
  partial gradients of sequence-parallel parameters over the tensor group and,
  for a model not wrapped in megatronapp's DDP, averages every gradient over
  the data-parallel group (SUM then divide: Gloo's AVG has a known silent
  bug). Wrapped models get the overlapped, bucketed, compressed reduction of
  ``megatronapp.data_parallel`` instead.
* :func:`clip_grad_norm_` — global gradient norm over a tensor-parallel model,
  counting each replicated parameter once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import torch

from . import _collectives
from .parallel_state import ParallelState
from .tensor_parallel.utils import is_tensor_parallel, resolve_state

_BUCKET_BYTES = 25 * 1024 * 1024


def _coalesced_all_reduce_(tensors: list, group, scale: float | None = None) -> None:
    """Sums `tensors` over `group` in place, packing same-dtype tensors into
    flat buckets of at most 25 MiB so that many small gradients cost few calls."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        bucket, size = [], 0
        for t in same + [None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= _BUCKET_BYTES):
                flat = _flatten_dense_tensors(bucket)
                _collectives.all_reduce_sum_(flat, group)
                if scale is not None:
                    flat.mul_(scale)
                for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    dst.copy_(src)
                bucket, size = [], 0


@torch.no_grad()
def finalize_model_grads(model, parallel_state: ParallelState | None = None) -> None:
    """Completes the gradients of one optimizer step (see module docstring).

    `model` is a module or a list of model chunks (pipeline parallelism). With
    :class:`~megatronapp.data_parallel.DistributedDataParallel` the
    data-parallel part is DDP's (already done at the end of backward); in
    ZeRO-1 mode the sequence-parallel sums happen on the shards, inside
    DistributedOptimizer. Under pipeline parallelism with tied embeddings, the
    word-embedding gradients of the first and last stage are summed over the
    embedding group (on the ZeRO-1 shards in ZeRO-1 mode)."""
    from .data_parallel import DistributedDataParallel

    state = resolve_state(parallel_state)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    shared = []
    for chunk in chunks:
        ddp = chunk if isinstance(chunk, DistributedDataParallel) else None
        module = ddp.module if ddp is not None else chunk
        if ddp is not None:
            ddp.finish_grad_sync()
            if ddp._zero:
                shared += [b.shard for b in ddp.buckets
                           if getattr(b.params[0], "shared_embedding", False)]
                continue
        params = [p for p in module.parameters() if p.grad is not None]
        shared += [p.grad for p in params if getattr(p, "shared_embedding", False)]
        if state.tp_size > 1:
            sp = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
            if sp:
                _coalesced_all_reduce_(sp, state.tensor_group)
        if ddp is None and state.dp_size > 1:
            _coalesced_all_reduce_([p.grad for p in params], state.data_group,
                                   scale=1.0 / state.dp_size)
    if shared and state.pp_size > 1 and state.embedding_group is not None:
        _coalesced_all_reduce_(shared, state.embedding_group)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    parallel_state: ParallelState | None = None,
) -> float:
    """Scales gradients so that their global L2 norm is at most `max_norm`;
    returns the norm before clipping. Sharded parameters contribute their shard
    on every tensor rank; replicated ones only on tensor rank 0."""
    state = resolve_state(parallel_state)
    params = [p for p in parameters if p.grad is not None]
    # The last pipeline stage's replica of tied embeddings is counted on the first.
    count_here = [p for p in params if (is_tensor_parallel(p) or state.tp_rank == 0)
                  and not getattr(p, "shared_embedding_replica", False)]
    total = torch.zeros(1, dtype=torch.float64)
    for p in count_here:
        total += p.grad.detach().double().pow(2).sum().cpu()
    _collectives.all_reduce_sum_(total, state.model_group)
    norm = math.sqrt(float(total))
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return norm
