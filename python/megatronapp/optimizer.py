"""ZeRO-1 distributed optimizer: optimizer state sharded over data-parallel ranks.

    model = mapp.data_parallel.DistributedDataParallel(model, compression="int8")
    opt = mapp.optimizer.DistributedOptimizer(model, torch.optim.AdamW, lr=3e-4,
                                              weight_decay=0.1)
    loss.backward()          # gradients reduce-scattered (compressed) during backward
    finalize_model_grads(model, optimizer=opt)  # SP / tied-embedding sums, on the shards
    opt.clip_grad_norm_(1.0)
    opt.step()               # shard update in fp32, then parameters all-gathered

(``from megatronapp.training import finalize_model_grads``; only needed with
sequence parallelism or tied embeddings split over pipeline stages.)

Constructor: ``DistributedOptimizer(ddp, optimizer_class=torch.optim.AdamW,
param_groups=None, **optimizer_kwargs)``.

* `ddp` — the :class:`~megatronapp.data_parallel.DistributedDataParallel`
  wrapping the model (or a list of them: one per pipeline model chunk); the
  optimizer switches it to reduce-scatter mode, so
  build the optimizer before the first backward.
* `optimizer_class` — any ``torch.optim.Optimizer`` (AdamW, SGD, ...), built
  over this rank's shard only, so its state takes ~1/dp of the memory.
* `param_groups` — optional list of dicts ``{"params": [model params], **options}``
  like a torch optimizer's groups (e.g. no weight decay for biases); default
  one group with `optimizer_kwargs`.

Each rank owns chunk r of every bucket (buckets are padded to equal chunks).
The intersection of a parameter with that chunk becomes a float32 "main"
tensor — float32 even when the model is bf16 — which is what the inner
optimizer updates; after the step the shards are cast back into the bucket's
parameter buffer and all-gathered, so every rank ends with identical
parameters.

Checkpoints see the shards through :meth:`DistributedOptimizer.shards`: per
piece, the parameter, its flat range [lo, hi) within the parameter, the fp32
main values and the inner optimizer's state for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _collectives, gradients
from .data_parallel import DistributedDataParallel
from .parallel_state import ParallelState, get_parallel_state

__all__ = ["DistributedOptimizer", "Shard"]


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


class DistributedOptimizer:
    def __init__(self, ddp: DistributedDataParallel, optimizer_class=torch.optim.AdamW,
                 param_groups: list | None = None, *,
                 parallel_state: ParallelState | None = None, **optimizer_kwargs):
        ddps = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
        if not ddps or not all(isinstance(d, DistributedDataParallel) for d in ddps):
            raise ValueError("DistributedOptimizer needs the model (or every pipeline model "
                             "chunk) wrapped in megatronapp.data_parallel.DistributedDataParallel")
        self.ddps = ddps
        self.ddp = ddps[0]
        for d in ddps:
            d.enable_distributed_optimizer()
        self.buckets = [b for d in ddps for b in d.buckets]
        self.group = self.ddp.group
        self.world, self.rank = self.ddp.world, self.ddp.group.rank()
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
        # Shard pieces: (bucket, param, lo, hi) in bucket coordinates, and the
        # fp32 main tensor the inner optimizer updates.
        self._pieces = []
        by_group = [[] for _ in group_opts]
        for b in self.buckets:
            s_lo, s_hi = self._chunk_range(b)
            for p, off in zip(b.params, b.offsets, strict=True):
                lo, hi = max(off, s_lo), min(off + p.numel(), s_hi)
                if lo >= hi:
                    continue
                main = b.param_data[lo:hi].detach().float().clone()
                self._pieces.append(_Piece(b, p, lo, hi, lo - s_lo, lo - off, main))
                by_group[options.get(p, 0)].append(main)
        groups = [dict(params=ps, **opts) for ps, opts in zip(by_group, group_opts, strict=True)]
        self.optimizer = optimizer_class(groups, **optimizer_kwargs)
        self.param_groups = self.optimizer.param_groups

    def _chunk_range(self, b) -> tuple:
        """[lo, hi) of this rank's chunk of bucket b."""
        chunk = b.param_data.numel() // self.world
        return self.rank * chunk, (self.rank + 1) * chunk

    # ---- the step -------------------------------------------------------------
    def grad_shards(self) -> list:
        """``(param, grad)`` of every piece, where ``grad`` is the averaged fp32
        gradient of the piece (a view into its bucket's shard, also set as
        ``main.grad``). Finishes the data-parallel reduction first."""
        for d in self.ddps:
            d.finish_grad_sync()  # no-op when backward already finished it
        for pc in self._pieces:
            pc.main.grad = pc.bucket.shard[pc.shard_lo: pc.shard_lo + pc.hi - pc.lo]
        return [(pc.param, pc.main.grad) for pc in self._pieces]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global gradient L2 norm from the shards (tensor-parallel shards count
        on every tp rank, replicated parameters once); scales if above max_norm."""
        groups = [self.group] + ([self.state_mp.model_group] if self.state_mp else [])
        return gradients.clip_grad_norm_(
            self.grad_shards(), max_norm, self.state_mp, groups,
            device=self.buckets[0].shard.device if self.buckets else None)

    @torch.no_grad()
    def step(self) -> None:
        self.grad_shards()
        self.optimizer.step()
        for pc in self._pieces:
            pc.bucket.param_data[pc.lo: pc.hi].copy_(pc.main)
        for b in self.buckets:
            lo, hi = self._chunk_range(b)
            b.param_data.copy_(_collectives.all_gather(b.param_data[lo:hi], 0, self.group))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.grad_data.zero_()
        for pc in self._pieces:
            pc.main.grad = None

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
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
