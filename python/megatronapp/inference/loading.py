"""A checkpoint's model, built for inference on this rank's stage."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["checkpoint_model_config", "load_model"]


def checkpoint_model_config(path: str):
    """(GPTConfig, the iter_* path) of a checkpoint directory (its latest)
    or iter_* path; ValueError naming the path when there is none or its
    metadata has no model config."""
    from ..checkpoint import CheckpointError, read_metadata
    from ..models import GPTConfig

    try:
        found = read_metadata(path)
    except CheckpointError as e:
        raise ValueError(f"{path}: {e}") from None
    if found is None:
        raise ValueError(f"{path}: no checkpoint there (a directory holding iter_* "
                         "checkpoints, or one iter_* path)")
    where, meta = found
    saved = meta.get("config") or {}
    if "vocab_size" not in saved:
        raise ValueError(f"{where}: its metadata has no model config")
    fields = set(GPTConfig.__dataclass_fields__)
    return GPTConfig(**{k: v for k, v in saved.items() if k in fields}), where


def load_model(path: str, tp: int = 1, pp: int = 1, dtype: torch.dtype | None = None,
               device=None):
    """This rank's stage of the checkpoint's model, in eval mode, with the
    layers split evenly over `pp` stages and the weights resharded for `tp`
    (any saving layout loads): (model, ParallelState). Call on every rank
    after ``torch.distributed.init_process_group``; the world must be tp x
    pp. Sequence parallelism, recomputation and dropout are off."""
    import torch.distributed as dist

    from .. import initialize_model_parallel
    from ..checkpoint import load
    from ..models import GPTModel

    cfg, where = checkpoint_model_config(path)
    world = dist.get_world_size()
    if world != tp * pp:
        raise ValueError(f"{world} ranks for --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp}: launch {tp * pp} ranks")
    if cfg.num_layers % pp:
        raise ValueError(f"the model's {cfg.num_layers} layers do not split evenly over "
                         f"--pipeline-model-parallel-size {pp}")
    for what, n in (("num_attention_heads", cfg.num_attention_heads),
                    ("vocab_size (padded)", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"the model's {what} {n} does not divide over "
                             f"--tensor-model-parallel-size {tp}")
    cfg = dataclasses.replace(cfg, sequence_parallel=False, recompute_granularity=None,
                              recompute_method=None, recompute_num_layers=None,
                              hidden_dropout=0.0, attention_dropout=0.0)
    state = initialize_model_parallel(tensor_model_parallel_size=tp,
                                      pipeline_model_parallel_size=pp)
    per = cfg.num_layers // pp
    first = state.pp_rank * per
    model = GPTModel(cfg, parallel_state=state, pre_process=state.pp_rank == 0,
                     post_process=state.pp_rank == pp - 1,
                     layer_numbers=list(range(first, first + per)))
    load(where, [model], parallel_state=state)
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model.eval(), state
