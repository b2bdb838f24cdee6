"""Inference: a KV cache in the attention layers, batched generation over
tensor- and pipeline-parallel ranks, and the model of a checkpoint built for
it. The server on top is :mod:`megatronapp.serve`.

    from megatronapp.inference import InferenceEngine, SamplingParams, load_model

    model, state = load_model("ckpt/", tp=2, pp=1)      # every rank
    engine = InferenceEngine(model, state, vocab=tok.vocab_size, eod=tok.eod)
    out = engine.generate([tok.tokenize("In the beginning")], [SamplingParams(max_tokens=20)])

The cache itself lives with the model (``megatronapp.models.kv_cache``:
the attention layers read it); it is re-exported here.
"""

from __future__ import annotations

from ..models import kv_cache
from .engine import Completion, InferenceEngine
from .loading import checkpoint_model_config, load_model
from .sampling import SamplingParams, choose

__all__ = ["kv_cache", "InferenceEngine", "Completion", "SamplingParams", "choose",
           "load_model", "checkpoint_model_config"]
