"""Muon (Megatron-LM's ``--optimizer muon`` and ``--muon-*`` flags): momentum
whose update is orthogonalized for the linear layers' weight matrices, AdamW
for everything else (embeddings, the output layer, norms, biases).

For a matrix with gradient g (Jordan et al., 2024; Megatron-Core's
``TensorParallelMuon``):

    m  = m + (1 - beta) (g - m)             (--muon-momentum beta, an EMA)
    u  = g + beta (m - g) if --muon-nesterov else m
    o  = NS(u)                              (--muon-num-ns-steps quintic Newton-Schulz
                                             steps: u's polar factor, about U V^T)
    w  = w (1 - lr wd) - lr s o             (s: --muon-scale-mode of the matrix's shape,
                                             times --muon-extra-scale-factor)

with the scale ``spectral`` sqrt(max(out, in)), ``shape_scaling``
sqrt(max(1, out / in)) or ``unit_rms_norm`` sqrt(out / in).

* **Tensor parallelism** (``--muon-tp-mode``): ``blockwise`` (Megatron's
  default) orthogonalizes each rank's shard on its own, with the shard's
  shape (no communication); ``duplicated`` all-gathers the shards along
  their split dimension, orthogonalizes the whole matrix and keeps this
  rank's part, so TP2 computes one rank's update.
* **QKV** (Megatron's ``--muon-split-qkv``, on by default here too;
  ``--no-muon-split-qkv``): the fused QKV weight is orthogonalized per query
  group as three matrices, queries, key and value.
* **ZeRO-1 and mixed precision**: as the inner optimizer of
  :class:`~megatronapp.optimizer.MixedPrecisionOptimizer` /
  :class:`~megatronapp.optimizer.DistributedOptimizer` Muon steps their flat
  fp32 main pieces. Momentum is elementwise, so it stays sharded with them;
  for the orthogonalization the wrapper (:attr:`Muon.whole_matrices`)
  all-gathers each bucket's momentum pieces over its data-parallel group,
  every rank orthogonalizes the whole matrices of the bucket (the same
  arithmetic as without ZeRO-1) and keeps the rows of its own pieces. Memory:
  the momentum is divided by dp like Adam's moments; compute: the
  Newton-Schulz iterations are not (each data-parallel rank runs all of
  them, as without ZeRO-1).
"""

from __future__ import annotations

import math

import torch.distributed as dist

import torch

__all__ = ["Muon", "newton_schulz", "scale_factor", "SCALE_MODES", "TP_MODES",
           "NS_COEFFICIENTS"]

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
TP_MODES = ("blockwise", "duplicated")
#: the quintic iteration's coefficients (Jordan et al.; torch.optim.Muon's defaults)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """About the polar factor U V^T of g [m, n] (float32): g normalized by its
    Frobenius norm, then `steps` of X <- a X + (b A + c A A) X, A = X X^T,
    on the wide orientation."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * (A @ A)) @ x
    return x.T if tall else x


def scale_factor(out: int, inp: int, mode: str) -> float:
    if mode == "spectral":
        return math.sqrt(max(out, inp))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, out / inp))
    if mode == "unit_rms_norm":
        return math.sqrt(out / inp)
    raise ValueError(f"--muon-scale-mode {mode!r}: expected one of {', '.join(SCALE_MODES)}")


class Muon(torch.optim.Optimizer):
    """Param groups with ``"muon": True`` take the Muon update, the others
    AdamW's (as ``torch.optim.AdamW``: decoupled weight decay, bias-corrected
    moments). `tp_group`: the tensor group (for ``duplicated``)."""

    def __init__(self, params, lr: float = 1e-3, *, momentum: float = 0.95,
                 nesterov: bool = False, ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, tp_mode: str = "blockwise",
                 split_qkv: bool = True, tp_group=None, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"--muon-momentum {momentum}: must be in [0, 1)")
        if ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps {ns_steps}: must be >= 1")
        scale_factor(1, 1, scale_mode)  # (checks the mode)
        if tp_mode not in TP_MODES:
            raise ValueError(f"--muon-tp-mode {tp_mode!r}: expected one of {', '.join(TP_MODES)}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                        betas=betas, eps=eps, weight_decay=weight_decay, muon=False)
        super().__init__(params, defaults)
        self.tp_mode, self.split_qkv, self.tp_group = tp_mode, split_qkv, tp_group
        #: None, or ``f(items, orthogonalize) -> updates`` set by a wrapper whose
        #: parameters are pieces of the model's matrices (ZeRO-1, mixed
        #: precision): for items ``(piece, group, u)`` the scaled orthogonal
        #: update of each piece, from ``orthogonalize(model_param, whole_u, group)``.
        self.whole_matrices = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["muon"]:
                    items.append((p, group, self._momentum(p, group)))
                else:
                    self._adamw(p, group)
        if items:
            if self.whole_matrices is not None:
                updates = self.whole_matrices(items, self.orthogonalize)
            else:
                updates = [self.orthogonalize(p, u, group) for p, group, u in items]
            for (p, group, _), o in zip(items, updates, strict=True):
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(o.to(p.dtype), alpha=-group["lr"])
        return loss

    def _adamw(self, p, group):
        """torch.optim.AdamW's single-tensor update, step for step."""
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        b1, b2 = group["betas"]
        lr, g = group["lr"], p.grad
        st["step"] += 1
        p.mul_(1 - lr * group["weight_decay"])
        st["exp_avg"].lerp_(g, 1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        step = float(st["step"])
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(group["eps"])
        p.addcdiv_(st["exp_avg"], denom, value=-lr / bc1)

    def _momentum(self, p, group):
        """Updates p's momentum; returns what is orthogonalized (Nesterov or not)."""
        st = self.state[p]
        if not st:
            st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        g, m, beta = p.grad, st["momentum_buffer"], group["momentum"]
        m.lerp_(g, 1 - beta)
        return g.lerp(m, beta) if group["nesterov"] else m

    def orthogonalize(self, p, u, group):
        """The scaled orthogonal update of this rank's part of p (a model
        parameter: its tensor-parallel and QKV attributes are read), from u
        shaped like p."""
        dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) \
            else None
        tp = self.tp_group.size() if self.tp_group is not None else 1
        whole = self.tp_mode == "duplicated" and dim is not None and tp > 1
        if whole:
            parts = [torch.empty_like(u) for _ in range(tp)]
            dist.all_gather(parts, u.contiguous(), group=self.tp_group)
            u = torch.cat(parts, dim=dim)
        split = getattr(p, "qkv_split_shapes", None) if self.split_qkv else None
        if split is not None:
            rows = sum(split)
            blocks = u.view(u.shape[0] // rows, rows, u.shape[1]).split(list(split), dim=1)
            o = torch.cat([self._scaled(b.reshape(-1, u.shape[1]), group).view(
                b.shape) for b in blocks], dim=1).view(u.shape)
        else:
            o = self._scaled(u, group)
        if whole:
            o = o.chunk(tp, dim=dim)[self.tp_group.rank()]
        return o

    @staticmethod
    def _scaled(u, group):
        return newton_schulz(u, group["ns_steps"]) * (
            scale_factor(u.shape[0], u.shape[1], group["scale_mode"])
            * group["extra_scale_factor"])
