"""FP8 training with per-tensor scaling (Megatron-LM's ``--fp8-format``,
``--fp8-recipe``, ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``,
``--fp8-margin``), emulated: each GEMM operand of the tensor-parallel
linears is scaled, rounded to an FP8 format and scaled back, and the
product is computed in float32 from those values, so the numerics are an
FP8 GEMM's (per-tensor scales, FP8 operands, fp32 accumulation) on any
device.

* **Formats.** ``e4m3``: every operand in E4M3 (max 448). ``hybrid``: the
  forward's inputs and weights in E4M3, the backward's output gradients in
  E5M2 (max 57344: more range, less precision), as Transformer Engine's
  HYBRID.
* **Scales.** An operand t is stored as ``fp8(t x scale)``; ``scale =
  fp8_max / amax / 2^margin``.
  - ``delayed`` (the default): the scale comes from the history of the
    operand's amax over the last ``--fp8-amax-history-len`` iterations
    (``max`` over it, or its ``most_recent`` entry); before the first update,
    from the operand's own amax over the tensor group (Transformer Engine
    starts from scale 1, where a first step's gradients underflow E5M2).
    Each iteration records
    the amaxes it meets; after backward, one all-reduce (MAX) over the ranks
    holding the same layers (tensor x data x context) makes them agree, the
    new scales are computed and the history rolls.
    Recomputation sees the same scales. The history and scales are
    checkpointed (``fp8_amax_history``, ``fp8_scale`` of each linear) and
    resume bit for bit.
  - ``tensorwise``: the scale of the operand's own amax, now (current
    scaling; on a tensor-parallel shard, the shard's).
* **Where.** The column- and row-parallel linears (attention's QKV and
  output, the MLP, the output layer when untied, MLA's up projections), with
  and without sequence parallelism, and their zero-bubble deferred weight
  gradients. The bias gradient comes from the unquantized output gradient.
  Not in FP8: embeddings, norms, attention's core, the grouped-query
  projection replicated over tensor ranks, MoE's routed experts (the shared
  expert is a ParallelMLP: in FP8), the duplicated linears (MLA's down
  projections, MTP's projection).

* **The GEMMs.** On a CUDA device of compute capability 8.9 or above (Ada,
  Hopper, Blackwell), the three GEMMs of each linear run in FP8 on the
  tensor cores (``torch._scaled_mm``: FP8 operands, per-tensor dequantizing
  scales, fp32 accumulation and output) whenever the shapes allow (every
  dimension a multiple of 16); elsewhere, and with ``MAPP_FP8_GEMM=emulate``,
  the product is computed in float32 from the dequantized operands. Both
  compute the same sums of the same FP8 products; they differ in rounding
  order only (``tests/gpu``). Transformer Engine and torchao are not needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

import torch

__all__ = ["FP8Recipe", "FORMATS", "RECIPES", "ALGOS", "enable", "update", "fp8_linear",
           "quantize", "to_fp8", "from_fp8", "fp8_modules", "gemm"]

FORMATS = ("e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise")
ALGOS = ("most_recent", "max")
INPUT, WEIGHT, GRAD = 0, 1, 2  #: the operand columns of a linear's history and scales


@dataclass(frozen=True)
class FP8Recipe:
    format: str = "hybrid"
    recipe: str = "delayed"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0

    def __post_init__(self):
        for name, value, allowed in (("--fp8-format", self.format, FORMATS),
                                     ("--fp8-recipe", self.recipe, RECIPES),
                                     ("--fp8-amax-compute-algo", self.amax_compute_algo, ALGOS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: expected one of {', '.join(allowed)}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len {self.amax_history_len}: must be >= 1")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin {self.margin}: must be >= 0")

    def dtype(self, operand: int) -> torch.dtype:
        if operand == GRAD and self.format == "hybrid":
            return torch.float8_e5m2
        return torch.float8_e4m3fn


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8(clamp(t x scale))``: t in FP8 `dtype` (saturating, round to nearest even)."""
    m = fp8_max(dtype)
    return (t.float() * scale).clamp(-m, m).to(dtype)


def from_fp8(t8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return t8.float() / scale


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to FP8 `dtype` at `scale` and back, in float32 (an FP8
    GEMM's operand, dequantized)."""
    return from_fp8(to_fp8(t, scale, dtype), scale)


def _tensor_cores(a8: torch.Tensor, b8: torch.Tensor) -> bool:
    """Whether a8 [M, K] x b8 [N, K]^T can run as one FP8 tensor-core GEMM."""
    if a8.device.type != "cuda" or os.environ.get("MAPP_FP8_GEMM", "auto") == "emulate":
        return False
    if torch.cuda.get_device_capability(a8.device) < (8, 9):
        return False
    if a8.dtype == b8.dtype == torch.float8_e5m2:  # (no E5M2 x E5M2 kernel)
        return False
    return all(d % 16 == 0 for d in (*a8.shape, b8.shape[0]))


def gemm(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """``from_fp8(a8, sa) @ from_fp8(b8, sb)^T`` in float32 for FP8 a8 [M, K]
    and b8 [N, K]: on FP8 tensor cores where the device and shapes allow
    (``torch._scaled_mm`` multiplies by the dequantizing scales 1/sa, 1/sb),
    else from the dequantized operands."""
    a8, b8 = a8.contiguous(), b8.contiguous()
    if _tensor_cores(a8, b8):
        return torch._scaled_mm(a8, b8.t(), scale_a=sa.reciprocal().float(),  # noqa: SLF001
                                scale_b=sb.reciprocal().float(), out_dtype=torch.float32)
    return from_fp8(a8, sa).matmul(from_fp8(b8, sb).t())


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.detach().abs().amax().float() if t.numel() else torch.zeros((), device=t.device)


class _Meta:
    """What a weight points to: the linear module holding its FP8 buffers."""

    __slots__ = ("module", "recipe", "ready")

    def __init__(self, module, recipe: FP8Recipe):
        self.module, self.recipe = module, recipe
        self.ready = None  # delayed: whether an update (or a checkpoint) set the scales

    def linear(self, x, weight, bias=None, group=None):
        """What ``autograd.linear`` and the sequence-parallel column linear
        call for a marked weight (they do not import this module)."""
        return fp8_linear(x, weight, bias, group)

    def scale(self, operand: int, t: torch.Tensor, record: bool = True) -> torch.Tensor:
        """The operand's scale; records its amax for the next update when
        `record` (training and recomputation do; evaluation does not)."""
        amax = _amax(t)
        if record:
            hist = self.module.fp8_amax_history
            hist[0, operand] = torch.maximum(hist[0, operand], amax.to(hist.device))
        top, one = fp8_max(self.recipe.dtype(operand)), torch.ones((), device=amax.device)
        if self.recipe.recipe == "tensorwise":
            return _scale_of(amax, top, self.recipe.margin, one)
        if self.ready is None:  # (one host read, at the first call)
            self.ready = bool((self.module.fp8_scale > 0).all())
        if not self.ready:
            # Before the first update: the operand's own amax over the tensor
            # group (a shard's scale would make TP2 differ from one rank), so
            # a first step's small gradients do not underflow.
            group = getattr(self.module, "group", None)
            if group is not None and group.size() > 1:
                amax = amax.clone()
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            return _scale_of(amax, top, self.recipe.margin, one).to(t.device)
        delayed = self.module.fp8_scale[operand].to(t.device)
        return torch.where(delayed > 0, delayed,  # (an operand that was all zeros so far)
                           _scale_of(amax, top, self.recipe.margin, one).to(t.device))


def _scale_of(amax, top: float, margin: int, previous):
    """fp8_max / amax / 2^margin where amax is a positive finite number, else
    the previous scale (an operand of zeros, or an overflow)."""
    ok = torch.isfinite(amax) & (amax > 0)
    new = top / torch.where(ok, amax, torch.ones_like(amax)) / (2.0 ** margin)
    return torch.where(ok, new, previous)


class _FP8Linear(torch.autograd.Function):
    """y = q(x) q(w)^T + b in float32; dx = q(dy) q(w), dw = q(dy)^T q(x)
    (deferrable in a zero-bubble BI), db = sum(dy). Under sequence
    parallelism (`group`), x is this rank's shard, quantized before the
    all-gather (the scale is shared, so it is the gathered tensor's
    quantization), and dx is reduce-scattered."""

    @staticmethod
    def forward(ctx, x, weight, bias, meta, group, record):
        r = meta.recipe
        sx, sw = meta.scale(INPUT, x, record), meta.scale(WEIGHT, weight, record)
        x8, w8 = to_fp8(x, sx, r.dtype(INPUT)), to_fp8(weight, sw, r.dtype(WEIGHT))
        ctx.meta, ctx.group, ctx.has_bias, ctx.dtype = meta, group, bias is not None, x.dtype
        # backward keeps the FP8 operands (1 byte an element) and their scales
        ctx.save_for_backward(x8, sx, w8, sw, weight)
        full = x8 if group is None else _gather8(x8, group)
        y = gemm(full.reshape(-1, full.shape[-1]), sx, w8, sw)
        y = y.view(*full.shape[:-1], y.shape[-1])
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from . import _collectives
        from .autograd import defer

        x8, sx, w8, sw, weight = ctx.saved_tensors
        meta = ctx.meta
        sg = meta.scale(GRAD, dy)
        g8 = to_fp8(dy, sg, meta.recipe.dtype(GRAD))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = gemm(g8.reshape(-1, g8.shape[-1]), sg, w8.t(), sw)
            dx = dx.view(*g8.shape[:-1], dx.shape[-1]).to(ctx.dtype)
            if ctx.group is not None:
                dx = _collectives.reduce_scatter_sum(dx.contiguous(), 0, ctx.group)
        if ctx.needs_input_grad[1]:
            group, wdtype = ctx.group, weight.dtype

            def wgrad(g8=g8, sg=sg, x8=x8, sx=sx):  # (kept in FP8 until a deferred W runs)
                full = x8 if group is None else _gather8(x8, group)
                return gemm(g8.reshape(-1, g8.shape[-1]).t(), sg,
                            full.reshape(-1, full.shape[-1]).t(), sx).to(wdtype)
            if not defer(weight, wgrad):
                dw = wgrad()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, dw, db, None, None, None


def _gather8(x8: torch.Tensor, group) -> torch.Tensor:
    """The sequence-parallel all-gather of an FP8 tensor, as its bytes (a
    quarter of float32's; the scale is shared over the group)."""
    from . import _collectives

    return _collectives.all_gather(x8.contiguous().view(torch.uint8), 0, group).view(x8.dtype)


def fp8_linear(x, weight, bias=None, group=None):
    """The FP8 linear of a weight that :func:`enable` marked (`group`: the
    tensor group under sequence parallelism, x being this rank's shard)."""
    # (the amaxes of a forward under no_grad, i.e. evaluation, do not count;
    # recomputation's forward runs with gradients and records them again)
    return _FP8Linear.apply(x, weight, bias, weight.fp8_meta, group, torch.is_grad_enabled())


def fp8_modules(chunks) -> list:
    """The linears holding FP8 state, in a fixed order."""
    out = []
    for c in chunks:
        mod = getattr(c, "module", c)
        out += [m for m in mod.modules() if hasattr(m, "fp8_amax_history")]
    return out


def enable(chunks, recipe: FP8Recipe) -> int:
    """Marks every column- and row-parallel linear of `chunks` (call after
    the model is on its device and in its dtype): each gets its float32
    ``fp8_amax_history`` [len, 3] and ``fp8_scale`` [3] (input, weight,
    output gradient), checkpointed. Returns how many."""
    from .tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    n = 0
    for c in chunks:
        mod = getattr(c, "module", c)
        for m in mod.modules():
            if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                continue
            dev = m.weight.device
            m.register_buffer("fp8_amax_history",
                              torch.zeros(recipe.amax_history_len, 3, device=dev))
            m.register_buffer("fp8_scale", torch.zeros(3, device=dev))  # 0: not yet set
            m._checkpointed_buffers = (  # noqa: SLF001 - checkpoint's protocol
                *getattr(m, "_checkpointed_buffers", ()), "fp8_amax_history", "fp8_scale")
            m.weight.fp8_meta = _Meta(m, recipe)
            n += 1
    return n


def update(chunks, recipe: FP8Recipe, groups=()) -> None:
    """After an iteration's backward (delayed scaling): the amaxes it
    recorded agree over `groups` (MAX), each operand's scale becomes
    ``fp8_max / amax / 2^margin`` of its history (max or most recent), and
    the history rolls (its newest row starts again from 0)."""
    mods = fp8_modules(chunks)
    if not mods or recipe.recipe != "delayed":
        for m in mods:  # tensorwise keeps no state across iterations
            m.fp8_amax_history.zero_()
        return
    current = torch.stack([m.fp8_amax_history[0] for m in mods])  # [n, 3]
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=g)
    tops = torch.tensor([fp8_max(recipe.dtype(i)) for i in (INPUT, WEIGHT, GRAD)],
                        device=current.device)
    for m, row in zip(mods, current, strict=True):
        hist = m.fp8_amax_history
        hist[0] = row.to(hist.device)
        amax = hist.amax(0) if recipe.amax_compute_algo == "max" else hist[0]
        m.fp8_scale.copy_(_scale_of(amax, tops.to(hist.device), recipe.margin, m.fp8_scale))
        if hist.shape[0] > 1:
            hist.copy_(torch.roll(hist, 1, 0))
        hist[0].zero_()
        m.weight.fp8_meta.ready = True
