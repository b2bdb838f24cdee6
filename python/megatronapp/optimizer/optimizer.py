"""Optimizers with float32 main parameters: mixed precision and ZeRO-1.

    model = mapp.data_parallel.DistributedDataParallel(bf16_model, grad_reduce_in_fp32=True)
    opt = mapp.optimizer.MixedPrecisionOptimizer(model, torch.optim.AdamW, lr=3e-4)
    # or, optimizer state sharded over data-parallel ranks (ZeRO-1):
    opt = mapp.optimizer.DistributedOptimizer(model, torch.optim.AdamW, lr=3e-4,
                                              weight_decay=0.1)
    loss.backward()          # gradients accumulate in fp32, reduced during backward
    finalize_model_grads(model, optimizer=opt)  # SP / tied-embedding sums
    opt.clip_grad_norm_(1.0)
    opt.step()               # fp32 update, then written back in the model's dtype

(``from megatronapp.training import finalize_model_grads``; only needed with
sequence parallelism or tied embeddings split over pipeline stages.)

Constructor: ``MixedPrecisionOptimizer(ddp, optimizer_class=torch.optim.AdamW,
param_groups=None, *, grad_scaler=None, **optimizer_kwargs)``, the same for
``DistributedOptimizer``.

* `ddp` — the :class:`~megatronapp.distributed.data_parallel.DistributedDataParallel`
  wrapping the model (or a list of them: one per pipeline model chunk).
  With a model in bf16/fp16 wrap it with ``grad_reduce_in_fp32=True``: each
  parameter's gradient then accumulates into ``param.main_grad``, a float32
  view into the bucket, which is what is reduced and what the step reads.
* `optimizer_class` — any ``torch.optim.Optimizer`` (AdamW, SGD, ...), built
  over float32 *main* tensors, never over the model's parameters.
* `param_groups` — optional list of dicts ``{"params": [model params], **options}``
  like a torch optimizer's groups (e.g. no weight decay for biases); default
  one group with `optimizer_kwargs`.
* `grad_scaler` — fp16: a :mod:`~megatronapp.optimizer.grad_scaler` scaler. Gradients
  are unscaled before the norm; a step whose global norm is not finite is
  skipped (:attr:`skipped_steps`) and the scaler updated.

Each rank owns a range of every bucket: all of it (:class:`MixedPrecisionOptimizer`)
or chunk r of it (:class:`DistributedOptimizer`; buckets are padded to equal
chunks, the DDP switches to reduce-scatter, parameters become views into
per-bucket parameter buffers). The intersection of a parameter with that range
becomes a float32 *main* tensor (the master weights, 1-D) that the inner
optimizer updates, its gradient the matching float32 slice of the bucket. After
the step the main values are cast into the model's dtype (and, ZeRO-1,
all-gathered), so every rank ends with identical parameters. Bytes per
parameter, bf16 with Adam: 2 (weights) + 4 (main gradients) + 4 (master) + 8
(moments) = 18, the last 12 divided by dp under ZeRO-1 — Megatron's numbers.

Checkpoints see the ranges through :meth:`MixedPrecisionOptimizer.shards`: per
piece, the parameter, its flat range [lo, hi) within the parameter, the fp32
main values and the inner optimizer's state for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _collectives
from ..distributed.data_parallel import DistributedDataParallel
from ..parallel_state import ParallelState, get_parallel_state
from . import clip_grads as gradients

__all__ = ["MixedPrecisionOptimizer", "DistributedOptimizer", "Shard", "FusedAdamW"]


@dataclass
class Shard:
    """The part of one parameter this rank updates (public view for checkpoints)."""

    param: torch.Tensor
    lo: int  #: flat range [lo, hi) within the parameter (this tensor-parallel shard of it)
    hi: int
    main: torch.Tensor  #: float32 main values; the inner optimizer's key
    state: dict  #: the inner optimizer's state of `main` (e.g. exp_avg, exp_avg_sq, step)


@dataclass
class _Piece:
    """The part of one parameter inside this rank's chunk of a bucket."""

    bucket: object
    param: torch.Tensor
    lo: int  # range in bucket coordinates
    hi: int
    shard_lo: int  # the same range relative to this rank's chunk
    param_lo: int  # the same range relative to the parameter
    main: torch.Tensor  # float32 copy the inner optimizer updates
    grad: torch.Tensor  # its averaged float32 gradient: a view into the bucket (or ZeRO-1 shard)


class MixedPrecisionOptimizer:
    """float32 main parameters and gradients for a model of any dtype, every
    data-parallel rank updating all of them (see the module docstring)."""

    #: whether each data-parallel rank owns only its chunk of every bucket
    sharded = False

    def __init__(self, ddp: DistributedDataParallel, optimizer_class=torch.optim.AdamW,
                 param_groups: list | None = None, *,
                 parallel_state: ParallelState | None = None, grad_scaler=None,
                 **optimizer_kwargs):
        ddps = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
        if not ddps or not all(isinstance(d, DistributedDataParallel) for d in ddps):
            raise ValueError(f"{type(self).__name__} needs the model (or every pipeline model "
                             "chunk) wrapped in megatronapp.distributed.DistributedDataParallel")
        self.ddps = ddps
        self.ddp = ddps[0]
        if self.sharded:
            for d in ddps:
                d.enable_distributed_optimizer()
        self.buckets = [b for d in ddps for b in d.buckets]
        self.group = self.ddp.group
        self.world, self.rank = self.ddp.world, self.ddp.group.rank()
        self.grad_scaler = grad_scaler
        self.skipped_steps = 0
        self._found_inf = False
        self._unscaled = False
        try:
            self.state_mp = parallel_state or get_parallel_state()
        except RuntimeError:
            self.state_mp = None
        options = {}
        if param_groups is not None:
            for i, g in enumerate(param_groups):
                for p in g["params"]:
                    options[p] = i
        group_opts = [{k: v for k, v in g.items() if k != "params"} for g in (param_groups or [{}])]
        # Shard pieces (the engine's layout: DistributedDataParallel.shard_pieces),
        # the fp32 main tensor the inner optimizer updates and its gradient view
        # (the engine's: GradReducer.main_params / main_grads / write_back).
        self._pieces, self._mains_of = [], []  # _mains_of: per chunk, its pieces' mains
        by_group = [[] for _ in group_opts]
        for d in ddps:
            r = d._reducer  # noqa: SLF001 - the engine under the front-end
            grads = r.main_grads(self.sharded)  # ValueError unless fp32 main gradients
            mains = r.main_params(self.sharded)
            for (b, p, lo, hi, shard_lo, param_lo), main, grad in zip(
                    d.shard_pieces(self.sharded), mains, grads, strict=True):
                self._pieces.append(_Piece(b, p, lo, hi, shard_lo, param_lo, main, grad))
                by_group[options.get(p, 0)].append(main)
            self._mains_of.append(mains)
        groups = [dict(params=ps, **opts) for ps, opts in zip(by_group, group_opts, strict=True)]
        self.optimizer = optimizer_class(groups, **optimizer_kwargs)
        self.param_groups = self.optimizer.param_groups
        if hasattr(self.optimizer, "whole_matrices"):  # megatronapp.optimizer.muon.Muon
            self._group_of = {p: self.optimizer.param_groups[i] for p, i in options.items()}
            # per bucket holding Muon matrices (the same on every rank, in order):
            # its matrices (param, offset, group) and this rank's pieces of each
            self._muon_buckets = []
            for b in self.buckets:
                mats = [(p, off, self._group_of[p]) for p, off in
                        zip(b.params, b.offsets, strict=True)
                        if self._group_of.get(p, {}).get("muon")]
                if mats:
                    muon, mine = {p for p, _, _ in mats}, {}
                    for pc in self._pieces:
                        if pc.bucket is b and pc.param in muon:
                            mine.setdefault(pc.param, []).append(pc)
                    self._muon_buckets.append((b, mats, mine))
            self.optimizer.whole_matrices = self._whole_matrix_updates

    # ---- what this rank owns (DistributedOptimizer: its chunk) ----------------------
    def _chunk_range(self, b) -> tuple:
        """[lo, hi) of the range of bucket b this rank updates."""
        return b.chunk_range(self.sharded)

    def _norm_groups(self) -> list:
        return [self.state_mp.model_group] if self.state_mp else []

    def _expert_norm_groups(self):
        """Full (unsharded) gradients: where experts' squares are summed (see
        gradients.global_norm)."""
        return self.state_mp.expert_norm_groups() if self.state_mp else None

    def _write_back(self) -> None:
        """The updated main values into the parameters (ZeRO-1: into this
        rank's chunk of each bucket), by the engine."""
        for d, mains in zip(self.ddps, self._mains_of, strict=True):
            d._reducer.write_back(mains, self.sharded)  # noqa: SLF001

    def _bucket_span(self, b) -> int:
        """Elements of bucket b in bucket coordinates (ZeRO-1: with its padding)."""
        return self._chunk_range(b)[1]

    @torch.no_grad()
    def _whole_matrix_updates(self, items, orthogonalize) -> list:
        """Muon's hook (megatronapp.optimizer.muon.Muon.whole_matrices): `items` are
        ``(main piece, group, u piece)``. Per bucket holding a Muon matrix
        (the same buckets on every rank, in order): the u pieces laid out in
        bucket coordinates and, under ZeRO-1, all-gathered over the bucket's
        group; each whole matrix orthogonalized (``orthogonalize(param, u,
        group)``); each piece's rows of it returned."""
        u_of = {id(main): u for main, _, u in items}
        out = {}
        for b, mats, mine in self._muon_buckets:
            buf = torch.zeros(self._bucket_span(b), dtype=torch.float32,
                              device=b.grad_data.device)
            for pcs in mine.values():
                for pc in pcs:
                    buf[pc.lo: pc.hi] = u_of[id(pc.main)]
            if self.sharded:
                lo, hi = self._chunk_range(b)
                buf = _collectives.all_gather(buf[lo:hi].contiguous(), 0, b.group)
            for p, off, group in mats:
                o = orthogonalize(p, buf[off: off + p.numel()].view(p.shape), group).reshape(-1)
                for pc in mine.get(p, ()):
                    out[id(pc.main)] = o[pc.param_lo: pc.param_lo + pc.hi - pc.lo]
        return [out[id(main)] for main, _, _ in items]

    # ---- the step -------------------------------------------------------------
    def grad_shards(self) -> list:
        """``(param, grad)`` of every piece, where ``grad`` is the averaged fp32
        gradient of the piece (a view into its bucket, also set as
        ``main.grad``), unscaled when a grad scaler is set. Finishes the
        data-parallel reduction first."""
        for d in self.ddps:
            d.finish_grad_sync()  # no-op when backward already finished it
        for pc in self._pieces:
            pc.main.grad = pc.grad
        grads = [pc.main.grad for pc in self._pieces]
        if self.grad_scaler is not None and not self._unscaled and grads:
            torch._foreach_mul_(grads, self.grad_scaler.inv_scale)  # noqa: SLF001
            self._unscaled = True
        return [(pc.param, pc.main.grad) for pc in self._pieces]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global gradient L2 norm (tensor-parallel shards count on every tp
        rank, replicated parameters once); scales if above max_norm. A norm
        that is not finite marks the step as overflowed: step() skips it."""
        norm = gradients.global_norm(self.grad_shards(), self.state_mp, self._norm_groups(),
                                     device=self.buckets[0].grad_data.device
                                     if self.buckets else None,
                                     expert_groups=self._expert_norm_groups())
        # Only a loss-scaled (fp16) run skips a step on overflow, as Megatron.
        self._found_inf = self.grad_scaler is not None and not math.isfinite(norm)
        if not self._found_inf:
            gradients.clip_([pc.main.grad for pc in self._pieces], max_norm, norm)
        return norm

    @torch.no_grad()
    def step(self) -> bool:
        """The update; returns False when it was skipped (fp16 overflow)."""
        if self.grad_scaler is not None:
            if not self._unscaled:  # no clip_grad_norm_ this step: check here
                self.clip_grad_norm_(0.0)
            self.grad_scaler.update(self._found_inf)
        self.grad_shards()
        if self._found_inf:
            self.skipped_steps += 1
            self._found_inf, self._unscaled = False, False
            return False
        self.optimizer.step()
        self._write_back()
        self._unscaled = False
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for d in self.ddps:
            d.zero_grad_buffer()
        for pc in self._pieces:
            pc.main.grad = None
        self._found_inf, self._unscaled = False, False

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    # ---- introspection ----------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of the inner optimizer's state (e.g. AdamW moments) on this rank."""
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    total += v.numel() * v.element_size()
        return total

    def main_param_bytes(self) -> int:
        """Bytes of this rank's float32 main parameters."""
        return sum(pc.main.numel() * pc.main.element_size() for pc in self._pieces)

    def shards(self) -> list:
        """This rank's :class:`Shard` of every parameter it updates."""
        return [Shard(pc.param, pc.param_lo, pc.param_lo + pc.hi - pc.lo, pc.main,
                      self.optimizer.state.setdefault(pc.main, {})) for pc in self._pieces]

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        scaler = state.pop("grad_scaler", None)
        if scaler is not None and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(scaler)
        self.optimizer.load_state_dict(state)


class DistributedOptimizer(MixedPrecisionOptimizer):
    """ZeRO-1: like :class:`MixedPrecisionOptimizer`, but data-parallel rank r
    owns only chunk r of every bucket: the main parameters and the inner
    optimizer's state take 1/dp of the memory (see the module docstring)."""

    sharded = True

    def __init__(self, ddp, optimizer_class=torch.optim.AdamW, param_groups: list | None = None,
                 *, overlap_param_gather: bool = False, **kwargs):
        """``overlap_param_gather``: the all-gather of the updated parameters
        returns at once and each module waits for its own buckets just before
        its next forward (Megatron-LM's ``--overlap-param-gather``); without
        it the step waits for the whole gather."""
        super().__init__(ddp, optimizer_class, param_groups, **kwargs)
        self.overlap_param_gather = overlap_param_gather

    def _bucket_span(self, b) -> int:
        return b.param_data.numel()

    def _norm_groups(self) -> list:
        # The shards are summed over dp too. Without an expert grid an
        # expert's shards partition it over the data group like any other
        # parameter's.
        return [self.group] + super()._norm_groups()

    def _expert_norm_groups(self):
        # An expert's shards partition it over its edp ranks.
        return self.state_mp.expert_norm_groups(sharded=True) if self.state_mp else None

    @torch.no_grad()
    def _write_back(self) -> None:
        for d in self.ddps:
            d.finish_param_sync()  # (the forward waited for them already)
        super()._write_back()
        for d in self.ddps:
            d.start_param_sync(force_sync=not self.overlap_param_gather)

    def finish_param_sync(self) -> None:
        """Waits for the parameter all-gathers in flight (overlap_param_gather)."""
        for d in self.ddps:
            d.finish_param_sync()


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW``'s update (decoupled weight decay, no amsgrad) in
    one pass over memory per tensor: ``torch.ops.mapp.fused_adamw_``, the C++
    core (``include/mapp/optim/adamw.h``; AVX2 where the CPU has it) on CPU
    tensors and a CUDA kernel over up to 32 tensors per launch on GPUs.
    torch's AdamW (its default, per-tensor loop) makes six passes.

    Same constructor, same per-group hyper-parameters and the same state keys
    (``step`` as a float32 scalar tensor, ``exp_avg``, ``exp_avg_sq``) as
    ``torch.optim.AdamW``, so checkpoints move between the two and it can be
    the inner optimizer of :class:`MixedPrecisionOptimizer` /
    :class:`DistributedOptimizer` (``--optimizer-impl fused``). Parameters
    must be float32 (the fp32 masters of a bf16/fp16 model are)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"FusedAdamW: invalid lr {lr}, eps {eps} or weight_decay "
                             f"{weight_decay} (each must be >= 0)")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"FusedAdamW: invalid betas {betas} (each in [0, 1))")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Tensors of one step count (a parameter whose grad was None on
            # some steps counts fewer) and one device go in one call.
            batches: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                if p.dtype != torch.float32:
                    raise TypeError(f"FusedAdamW steps float32 parameters, got {p.dtype}; keep "
                                    "fp32 master weights (MixedPrecisionOptimizer) for bf16/fp16")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.contiguous_format)
                state["step"] += 1
                key = (int(state["step"].item()), p.device)
                batches.setdefault(key, ([], [], [], []))
                if not p.is_contiguous():
                    raise ValueError("FusedAdamW updates parameters in place and needs them "
                                     "contiguous; got one with strides " + str(p.stride()))
                ps, gs, ms, vs = batches[key]
                ps.append(p)
                gs.append(p.grad.contiguous())  # read only: a copy is fine
                ms.append(state["exp_avg"])
                vs.append(state["exp_avg_sq"])
            beta1, beta2 = group["betas"]
            for (step, _), (ps, gs, ms, vs) in batches.items():
                torch.ops.mapp.fused_adamw_(ps, gs, ms, vs, float(group["lr"]), float(beta1),
                                            float(beta2), float(group["eps"]),
                                            float(group["weight_decay"]), step)
        return loss
