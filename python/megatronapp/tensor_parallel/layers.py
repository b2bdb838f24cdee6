"""Tensor-parallel layers (Megatron-LM's weight layouts).

Weights are created as the full (master) matrix from the global RNG and then
sliced, so for a given seed the model computes the same function at every
tensor-parallel size (see ``utils.sharded_parameter``). Pass ``init_method`` to
replace the default initialization (that of ``nn.Linear`` / ``nn.Embedding``);
it is applied to the full tensor.

Each layer takes ``parallel_state=None`` (the default state) or an explicit
:class:`~megatronapp.parallel_state.ParallelState`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.nn.functional as F

import torch
from torch import nn

from .. import _collectives
from ..autograd import linear, weight_and_bias_grads
from ..parallel_state import ParallelState
from . import mappings, overlap
from .utils import divide, resolve_state, sharded_parameter


class _SequenceParallelLinear(torch.autograd.Function):
    """``linear(all_gather(x), weight, bias)`` over the sequence dim (0) that
    keeps only this rank's sequence shard for backward and gathers it again
    there (Megatron's sequence-parallel linear): the saved input is 1/tp of
    the gathered one. Backward reduce-scatters the input gradient; the weight
    gradient is deferred like :func:`megatronapp.autograd.linear`'s inside a
    zero-bubble BI (its closure keeps the re-gathered input until W)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_collectives.all_gather(x.contiguous(), 0, group), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = _collectives.reduce_scatter_sum(dy.matmul(weight).contiguous(), 0, ctx.group)

        def gathered():  # the weight gradient needs the whole sequence again
            return _collectives.all_gather(x.contiguous(), 0, ctx.group)
        return (dx, *weight_and_bias_grads(ctx, dy, gathered, weight), None)


def _linear_weight_init(weight: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # as nn.Linear.reset_parameters


def _bias_init(fan_in: int, init_method) -> Callable[[torch.Tensor], None]:
    """nn.Linear's bias init by default; zeros when a custom init_method is given."""
    if init_method is not None:
        return nn.init.zeros_
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda b: nn.init.uniform_(b, -bound, bound)


def _check_ids(ids: torch.Tensor, num_embeddings: int) -> None:
    """Token ids outside [0, num_embeddings) are an error. On the host it is
    raised here; on a GPU it is a device-side assertion, so that the check
    costs no device-to-host synchronization per microbatch."""
    msg = f"VocabParallelEmbedding: token ids must lie in [0, {num_embeddings})"
    if ids.device.type != "cpu":
        torch._assert_async(((ids >= 0) & (ids < num_embeddings)).all(), msg)  # noqa: SLF001
        return
    lo, hi = torch.aminmax(ids)
    if int(lo) < 0 or int(hi) >= num_embeddings:
        raise IndexError(f"{msg}, got values in [{int(lo)}, {int(hi)}]")


def _no_fp8(meta, layer: nn.Module) -> None:
    if meta is not None:
        raise NotImplementedError(
            f"{type(layer).__name__}: FP8 and tp_comm_overlap do not run together yet; "
            "drop --tp-comm-overlap or --fp8-format")


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features) across the tensor group.

    ``.weight`` is [out/tp, in] and holds rows [r*out/tp, (r+1)*out/tp) of the
    full weight on tensor rank r; ``.bias`` is [out/tp]. With ``stacked=k`` the
    output features are k blocks (SwiGLU's gate and up), each split over the
    group: rank r holds block rows r of each, in order. The output is this
    rank's slice of the last dim, or the full output with ``gather_output=True``.
    With ``sequence_parallel=True`` the input is sharded along dim 0 (sequence,
    Megatron's [s, b, h]) and all-gathered before the matmul; ``tp_comm_overlap``
    (:class:`~megatronapp.tensor_parallel.overlap.TPCommOverlap`) hides that
    gather and the backward's collectives behind the GEMMs.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        *,
        init_method: Callable[[torch.Tensor], None] | None = None,
        parallel_state: ParallelState | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        stacked: int = 1,
        tp_comm_overlap: overlap.TPCommOverlap | None = None,
    ) -> None:
        super().__init__()
        state = resolve_state(parallel_state)
        if gather_output and (sequence_parallel or stacked > 1):
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with "
                "sequence_parallel=True (the next layer expects a sequence shard) or stacked > 1"
            )
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.tp_comm_overlap = tp_comm_overlap
        self.group = state.tensor_group
        tp = state.tp_size
        self.output_size_per_partition = divide(
            out_features, tp, "ColumnParallelLinear out_features")
        kw = {"dtype": dtype, "device": device}
        self.weight = sharded_parameter((out_features, in_features), 0, state,
                                        init_method or _linear_weight_init, stacked=stacked, **kw)
        if bias:
            self.bias = sharded_parameter((out_features,), 0, state,
                                          _bias_init(in_features, init_method), stacked=stacked,
                                          **kw)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = getattr(self.weight, "fp8_meta", None)  # megatronapp.fp8
        if self.tp_comm_overlap is not None and self.sequence_parallel and self.group.size() > 1:
            _no_fp8(meta, self)
            y = overlap.column_linear(x, self.weight, self.bias, self.group, self.tp_comm_overlap)
        elif self.sequence_parallel and self.group.size() > 1 and (
                torch.is_grad_enabled() and self.weight.requires_grad):
            if meta is not None:
                y = meta.linear(x, self.weight, self.bias, self.group)
            else:
                y = _SequenceParallelLinear.apply(x, self.weight, self.bias, self.group)
        else:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, True, self.group)
            else:
                x = mappings.copy_to_tensor_model_parallel_region(x, self.group)
            y = linear(x, self.weight, self.bias)
        if self.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.output_size_per_partition}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features) across the tensor group.

    ``.weight`` is [out, in/tp] and holds columns [r*in/tp, (r+1)*in/tp) of the
    full weight; ``.bias`` is the full [out], added once after the reduction.
    The input is this rank's slice of the last dim (``input_is_parallel=True``)
    or the full input, which is then split. Partial products are summed with an
    all-reduce, or with a reduce-scatter along dim 0 under ``sequence_parallel``
    (behind the GEMM with ``tp_comm_overlap``, as in :class:`ColumnParallelLinear`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        *,
        init_method: Callable[[torch.Tensor], None] | None = None,
        parallel_state: ParallelState | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        tp_comm_overlap: overlap.TPCommOverlap | None = None,
    ) -> None:
        super().__init__()
        state = resolve_state(parallel_state)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.tp_comm_overlap = tp_comm_overlap
        self.group = state.tensor_group
        tp = state.tp_size
        self.input_size_per_partition = divide(in_features, tp, "RowParallelLinear in_features")
        kw = {"dtype": dtype, "device": device}
        self.weight = sharded_parameter((out_features, in_features), 1, state,
                                        init_method or _linear_weight_init, **kw)
        if bias:
            self.bias = sharded_parameter((out_features,), None, state,
                                          _bias_init(in_features, init_method), **kw)
            # Under sequence parallelism each rank adds the bias to its own
            # sequence shard, so its gradient is a partial sum over the group.
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, self.group)
        if self.tp_comm_overlap is not None and self.sequence_parallel and self.group.size() > 1:
            _no_fp8(getattr(self.weight, "fp8_meta", None), self)
            y = overlap.row_linear(x, self.weight, self.group, self.tp_comm_overlap)
            return y + self.bias if self.bias is not None else y
        y = linear(x, self.weight)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.input_size_per_partition}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class DuplicatedLinear(nn.Module):
    """A bias-free linear layer whole on every tensor rank (Megatron's
    "duplicated" parallel mode: MLA's down projections, MTP's projection),
    applied to this rank's input as is. Under sequence parallelism that input
    is the rank's sequence shard and the weight's gradient a partial sum over
    the tensor group (``sequence_parallel=True`` marks it for that sum);
    otherwise every rank computes the same gradient."""

    def __init__(self, in_features: int, out_features: int, *, sequence_parallel: bool = False,
                 init_method: Callable[[torch.Tensor], None] | None = None,
                 parallel_state: ParallelState | None = None):
        super().__init__()
        state = resolve_state(parallel_state)
        self.weight = sharded_parameter((out_features, in_features), None, state,
                                        init_method or nn.init.xavier_normal_)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary) across the tensor group.

    ``.weight`` is [V/tp, D] and holds rows [r*V/tp, (r+1)*V/tp) of the full
    table. Each rank looks up the ids it owns, zeroes the rest, and the partial
    results are summed (all-reduce; reduce-scatter along dim 0 when
    ``sequence_parallel=True``, for inputs laid out [s, b]).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        sequence_parallel: bool = False,
        init_method: Callable[[torch.Tensor], None] | None = None,
        parallel_state: ParallelState | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        state = resolve_state(parallel_state)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.group = state.tensor_group
        tp, rank = state.tp_size, state.tp_rank
        self.num_embeddings_per_partition = divide(
            num_embeddings, tp, "VocabParallelEmbedding num_embeddings (vocabulary size)")
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = sharded_parameter((num_embeddings, embedding_dim), 0, state,
                                        init_method or nn.init.normal_, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel():
            _check_ids(ids, self.num_embeddings)
        if self.group.size() > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out, self.group)
        return mappings.reduce_from_tensor_model_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} "
                f"(local rows [{self.vocab_start_index}, {self.vocab_end_index}))")
