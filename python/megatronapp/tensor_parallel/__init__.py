"""Tensor (and sequence) parallel building blocks, Megatron-LM compatible."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, DuplicatedLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .overlap import TPCommOverlap
from .random import (
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_seed,
)
from .utils import gather_full_state_dict, load_full_state_dict

__all__ = [
    "ColumnParallelLinear",
    "DuplicatedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "TPCommOverlap",
    "vocab_parallel_cross_entropy",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "gather_full_state_dict",
    "load_full_state_dict",
    "checkpoint",
    "get_rng_tracker",
    "get_cuda_rng_tracker",
    "model_parallel_seed",
    "model_parallel_cuda_manual_seed",
]
