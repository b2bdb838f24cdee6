"""Tensor-parallel communication overlapped with the GEMMs (``--tp-comm-overlap``).

Under sequence parallelism every column-parallel linear all-gathers its input
along the sequence and every row-parallel linear reduce-scatters its output;
the backward does the mirror images. Megatron-Core hides these behind the
GEMMs with Transformer Engine's userbuffers (GPU only); here the same
decomposition runs on any device, with the collectives on the tensor group's
communication thread (``torch.ops.mapp.all_gather_async`` /
``reduce_scatter_async``; on CUDA a side stream ordered after the producer):

- **ag** (column forward, row backward): this rank's sequence shard is cut into
  ``splits`` pieces; piece j of every rank is all-gathered while the GEMM of
  piece j-1 runs. The output rows land where the unsplit GEMM puts them.
- **rs** (row forward; with **rs_dgrad** also the column's input gradient): the
  GEMM is cut the same way and each piece's partial sums are reduce-scattered
  while the next piece's GEMM runs.
- **bulk_dgrad** (column backward): the input all-gather that the weight
  gradient needs runs behind the input-gradient GEMM.
- **bulk_wgrad** (column backward): the input gradient's reduce-scatter runs
  behind the weight-gradient GEMM (not when zero-bubble defers that GEMM).

The arithmetic is the unsplit linear's: every output element is the same dot
product (only the row blocks given to the GEMM differ), and the weight
gradient is one GEMM over the gathered tensors as without overlap, so it
composes with deferred weight gradients (zero-bubble). Every collective of the
group inside these functions goes through the communication thread and is
waited for before the function returns, so ranks issue them in one order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.nn.functional as F

import torch

from ..autograd import weight_and_bias_grads


@dataclass(frozen=True)
class TPCommOverlap:
    """Which overlaps run (Megatron-LM's ``--tp-comm-overlap`` and its
    ``--disable-tp-comm-*`` / ``--tp-comm-overlap-rs-dgrad`` flags) and into
    how many pieces a pipelined GEMM is cut (Transformer Engine's
    ``num_splits``; the largest divisor of the local sequence length not above
    it is used)."""

    ag: bool = True
    rs: bool = True
    rs_dgrad: bool = False
    bulk_dgrad: bool = True
    bulk_wgrad: bool = True
    splits: int = 4

    def __post_init__(self) -> None:
        if self.splits < 1:
            raise ValueError(f"tp comm overlap: splits must be >= 1, got {self.splits}")


def _pieces(rows: int, splits: int) -> int:
    """The largest divisor of `rows` that is at most `splits`."""
    return max(k for k in range(1, min(rows, splits) + 1) if rows % k == 0)


_all_gather_async_op = torch.ops.mapp.all_gather_async
_reduce_scatter_async_op = torch.ops.mapp.reduce_scatter_async


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup):
    """(out, work): `x` of every member stacked along dim 0, once waited."""
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    return out, _all_gather_async_op(out, x, group.group_name)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup):
    return _reduce_scatter_async_op(out, x, group.group_name)


def _wait(work) -> None:
    torch.ops.mapp.wait_comm(work)


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  group: dist.ProcessGroup, splits: int, *, keep: bool = False):
    """``F.linear(all_gather(x, dim 0), weight, bias)`` with the gather cut
    into pieces, each piece's GEMM running while the next piece travels
    (`splits` 1: one gather, then the GEMM). With `keep`, returns (output,
    the gathered x in the unsplit row order) instead of the output."""
    x = x.contiguous()
    tp, rows = group.size(), x.shape[0]
    k = _pieces(rows, splits)
    c = rows // k
    flights = [_all_gather(x[j * c:(j + 1) * c], group) for j in range(k)]  # in order
    y, pieces = None, []
    for j in range(k):
        g, work = flights[j]
        _wait(work)
        flights[j] = None  # the piece is freed once its GEMM is done (unless kept)
        yj = F.linear(g, weight, bias)
        if k == 1:  # the gather's rank order is the output's
            y = yj
        else:
            if y is None:
                y = yj.new_empty((tp, k, c, *yj.shape[1:]))
            y[:, j] = yj.view(tp, c, *yj.shape[1:])
        if keep:
            pieces.append(g.view(tp, c, *g.shape[1:]))
    if k > 1:
        y = y.view(tp * rows, *y.shape[3:])
    if not keep:
        return y
    full = pieces[0] if k == 1 else torch.stack(pieces, dim=1)
    return y, full.reshape(tp * rows, *x.shape[1:])


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup,
                          splits: int) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), dim 0)`` with the GEMM cut into
    pieces, each piece's partial sums reduce-scattered while the next piece's
    GEMM runs."""
    tp = group.size()
    rows = x.shape[0] // tp  # this rank's rows of the output
    k = _pieces(rows, splits)
    c = rows // k
    xv = x.reshape(tp, k, c, *x.shape[1:])
    out, works = None, []
    for j in range(k):
        p = F.linear(xv[:, j], weight)  # [tp, c, ..., out]: rank r's rows of piece j
        p = p.reshape(tp * c, *p.shape[2:])
        if out is None:
            out = p.new_empty((rows, *p.shape[1:]))
        works.append(_reduce_scatter_into(out[j * c:(j + 1) * c], p, group))
    for w in works:
        _wait(w)
    return out


class _ColumnLinear(torch.autograd.Function):
    """The sequence-parallel column linear (``all_gather`` then ``linear``)
    with its collectives overlapped; saves only this rank's sequence shard."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, ov):
        ctx.group, ctx.ov, ctx.has_bias = group, ov, bias is not None
        ctx.save_for_backward(x, weight)
        return gather_linear(x, weight, bias, group, ov.splits if ov.ag else 1)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group, ov = ctx.group, ctx.ov
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathered = gather = None
        if need_w:  # the weight gradient needs the whole sequence again
            gathered, gather = _all_gather(x.contiguous(), group)
            if not ov.bulk_dgrad:
                _wait(gather)
        dx = scatter = None
        if need_x:
            if ov.rs_dgrad:  # the GEMM itself cut into pieces, each scattered behind the next
                dx = linear_reduce_scatter(dy, weight.t(), group, ov.splits)
            else:
                partial = dy.matmul(weight).contiguous()
                dx = partial.new_empty((partial.shape[0] // group.size(), *partial.shape[1:]))
                scatter = _reduce_scatter_into(dx, partial, group)
                if not ov.bulk_wgrad:
                    _wait(scatter)
        if gather is not None:
            _wait(gather)
        dw, db = weight_and_bias_grads(ctx, dy, lambda: gathered, weight)
        if scatter is not None:
            _wait(scatter)
        return dx, dw, db, None, None


class _RowLinear(torch.autograd.Function):
    """The sequence-parallel row linear without its bias (``linear`` then
    ``reduce_scatter``) with its collectives overlapped."""

    @staticmethod
    def forward(ctx, x, weight, group, ov):
        ctx.group, ctx.ov, ctx.has_bias = group, ov, False
        ctx.save_for_backward(x, weight)
        return linear_reduce_scatter(x, weight, group, ov.splits if ov.rs else 1)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group, ov = ctx.group, ctx.ov
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        if need_x:  # the input gradient's GEMM behind the gather of dy's pieces
            out = gather_linear(dy, weight.t(), None, group, ov.splits if ov.ag else 1,
                                keep=need_w)
            dx, full = out if need_w else (out, None)
        else:
            full, work = _all_gather(dy.contiguous(), group)
            _wait(work)
        if need_w:  # one GEMM over the gathered gradient, in the unsplit row order
            dw, _ = weight_and_bias_grads(ctx, full, lambda: x, weight)
        return dx, dw, None, None


def column_linear(x, weight, bias, group, ov: TPCommOverlap) -> torch.Tensor:
    return _ColumnLinear.apply(x, weight, bias, group, ov)


def row_linear(x, weight, group, ov: TPCommOverlap) -> torch.Tensor:
    return _RowLinear.apply(x, weight, group, ov)


def enable(modules, ov: TPCommOverlap | None) -> int:
    """Sets `ov` on every sequence-parallel module of `modules` that has a
    ``tp_comm_overlap`` attribute (the column/row-parallel linears, the tied
    output layer of GPTModel, the replicated-group QKV) and whose tensor group
    has more than one rank; returns how many."""
    n = 0
    for chunk in modules:
        for m in chunk.modules():
            if hasattr(m, "tp_comm_overlap") and m.sequence_parallel and m.group.size() > 1:
                m.tp_comm_overlap = ov
                n += 1
    return n
