"""A checkpoint's model, built for inference on this rank's stage."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["checkpoint_model_config", "load_model", "UNSTORED_SEQ_LENGTH"]

#: the longest sequence of a checkpoint that stores none (rotary or no
#: position embeddings: nothing limits it but memory); --seq-length overrides
UNSTORED_SEQ_LENGTH = 4096


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
    cfg = {k: v for k, v in saved.items() if k in fields}
    if "seq_length" not in cfg:  # RoPE / no positions: no table, so no length is stored
        cfg["seq_length"] = UNSTORED_SEQ_LENGTH
    return GPTConfig(**cfg), where


def load_model(path: str, tp: int = 1, pp: int = 1, dtype: torch.dtype | None = None,
               device=None, seq_length: int | None = None):
    """This rank's stage of the checkpoint's model, in eval mode, with the
    layers split evenly over `pp` stages and the weights resharded for `tp`
    (any saving layout loads): (model, ParallelState). Call on every rank
    after ``torch.distributed.init_process_group``; the world must be tp x
    pp. Sequence parallelism, recomputation and dropout are off.
    `seq_length`: the longest prompt + completion (default the checkpoint's;
    a learned position table cannot be exceeded)."""
    import torch.distributed as dist

    from .. import initialize_model_parallel
    from ..checkpoint import load
    from ..models import GPTModel

    cfg, where = checkpoint_model_config(path)
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-model-parallel-size {tp} and --pipeline-model-parallel-size "
                         f"{pp} must be >= 1")
    if cfg.num_layers % pp:
        raise ValueError(f"the model's {cfg.num_layers} layers do not split evenly over "
                         f"--pipeline-model-parallel-size {pp}")
    for what, n in (("num_attention_heads", cfg.num_attention_heads),
                    ("vocab_size (padded)", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"the model's {what} {n} does not divide over "
                             f"--tensor-model-parallel-size {tp}")
    if seq_length is not None:
        if seq_length < 1:
            raise ValueError(f"--seq-length {seq_length}: must be >= 1")
        if cfg.position_embedding_type == "learned_absolute" and seq_length > cfg.seq_length:
            raise ValueError(f"--seq-length {seq_length}: the model's learned position table "
                             f"has {cfg.seq_length} rows")
        cfg = dataclasses.replace(cfg, seq_length=seq_length)
    world = dist.get_world_size()
    if world != tp * pp:
        raise ValueError(f"{world} ranks for --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp}: launch {tp * pp} ranks")
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
