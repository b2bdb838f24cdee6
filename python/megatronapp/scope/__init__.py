"""MegaScope: see inside the model while it trains or generates, and perturb it.

A :class:`Scope` watches named internals of a GPT (per layer) and perturbs
them, reproducibly by seed::

    scope = Scope(chunks)                         # every rank
    scope.watch("attn_probs", layers=[0], reduce="none")
    scope.watch("residual", reduce="bins", bins=64)
    scope.perturb("mlp_out", "gaussian", layers=[1], std=0.5, steps=1, seed=7)
    with scope.step():                            # one forward (or training step)
        model(tokens)
    internals = scope.collect()                   # collective; rank 0 gets the dict

Sites (``SITES``): ``query``, ``key``, ``value`` (``qkv`` names the three),
``attn_probs`` (per head), ``attn_context``, ``mlp_in``, ``mlp_out``,
``residual`` (the stream after the layer) and ``logits`` (the final
vocabulary scores; its layer number is ``num_layers``).

Each watched tensor is reduced on the rank that produced it with one of a
fixed set of reducers (``REDUCERS``: none, mean, max, absmax, bins, topk);
there is no user-supplied code. Heads split over the tensor group are
reduced locally and concatenated in head order; sequence-parallel and
vocabulary-sharded tensors are gathered over the tensor group first.
:meth:`Scope.collect` then gathers every stage's records to global rank 0
(one ``gather_object`` over the world).

Cost when off: the model reads one module global per tap point
(``megatronapp.models.scope_taps.ACTIVE``); a scope with nothing watched and no
perturbation armed does not even set it.

Perturbations (``KINDS``): ``gaussian`` (x + std * N(0, 1)), ``uniform``
(x * (1 + scale * U(-1, 1))), ``bitflip`` (flip bit ``bit`` of a
``fraction`` of the values, in their own dtype: fp32 bits 0-31, bf16/fp16
0-15) and ``zero_head`` (head ``head`` set to 0; sites with heads). Noise is
drawn over the *global* tensor from a generator seeded by (seed, site,
layer, step) and each rank keeps its slice, so a perturbed run is the same
function at every tensor-parallel size, and recomputation re-applies exactly
the same noise. ``weights`` perturbs a parameter (by its global name, as in
checkpoints) in place; in generation the original is restored when the
perturbation expires or is cleared. Every perturbed step is recorded in
:attr:`Scope.log` (and, in training, in the iteration's record and CSV).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

import torch

from ..models import scope_taps as taps

__all__ = ["Scope", "ScopeError", "Probe", "Perturbation", "SITES", "REDUCERS", "KINDS",
           "reduce_tensor", "check_perturbation"]

SITES = ("query", "key", "value", "attn_probs", "attn_context", "mlp_in", "mlp_out",
         "residual", "logits")
HEAD_SITES = ("query", "key", "value", "attn_probs", "attn_context")
PERTURB_SITES = SITES + ("weights",)
REDUCERS = ("none", "mean", "max", "absmax", "bins", "topk")
KINDS = ("gaussian", "uniform", "bitflip", "zero_head")
#: The most values one watched tensor may send unreduced (reduce="none").
MAX_ELEMENTS = 1 << 22


class ScopeError(ValueError):
    """A request the scope cannot serve; the message says what to change."""


@dataclass
class Probe:
    """What to record at one site: which layers (None: all), which batch
    sample, and how to reduce it on the producing rank."""

    site: str
    layers: list | None = None
    reduce: str = "bins"
    bins: int = 64
    dim: int = -1
    k: int = 5
    sample: int = 0


@dataclass
class Perturbation:
    site: str
    kind: str
    layers: list | None = None
    std: float = 0.0
    scale: float = 0.0
    bit: int = 0
    fraction: float = 1.0
    head: int = 0
    name: str | None = None  #: weights: the parameter's global name
    steps: int | None = 1  #: None: until cleared
    seed: int = 0
    id: int = 0
    applied: list = field(default_factory=list)  #: steps it applied at

    def describe(self) -> str:
        arg = {"gaussian": f"std={self.std}", "uniform": f"scale={self.scale}",
               "bitflip": f"bit={self.bit},fraction={self.fraction}",
               "zero_head": f"head={self.head}"}[self.kind]
        where = self.name if self.site == "weights" else (
            "all" if self.layers is None else ",".join(map(str, self.layers)))
        return f"{self.site}[{where}]:{self.kind}({arg},seed={self.seed})"


def _check_int(name, v, lo, hi=None):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ScopeError(f"{name} must be an integer {span}, got {v!r}")


def _check_float(name, v, lo=0.0):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo or v != v:
        raise ScopeError(f"{name} must be a number >= {lo}, got {v!r}")


def check_perturbation(site, kind) -> None:
    """ScopeError unless `site` and `kind` name a perturbation site and kind."""
    if site not in PERTURB_SITES:
        raise ScopeError(f"unknown perturbation site {site!r}: expected one of "
                         f"{', '.join(PERTURB_SITES)}")
    if kind not in KINDS:
        raise ScopeError(f"unknown perturbation kind {kind!r}: expected one of "
                         f"{', '.join(KINDS)}")


def reduce_tensor(t: torch.Tensor, probe: Probe):
    """One sample's tensor (float32, features last) reduced by the probe:
    a tensor, or ``{"values", "indices"}`` for topk."""
    if probe.reduce == "none":
        if t.numel() > MAX_ELEMENTS:
            raise ScopeError(f"{probe.site}: {t.numel()} values exceed the {MAX_ELEMENTS} a "
                             "probe may send unreduced; use reduce='bins' or 'mean'")
        return t
    if probe.reduce in ("mean", "max", "absmax"):
        if not -t.dim() <= probe.dim < t.dim():
            raise ScopeError(f"{probe.site}: dim {probe.dim} out of range for a "
                             f"{t.dim()}-d tensor {list(t.shape)}")
        if probe.reduce == "mean":
            return t.mean(probe.dim)
        return (t.abs() if probe.reduce == "absmax" else t).amax(probe.dim)
    if probe.reduce == "bins":
        n = t.shape[-1]
        if n <= probe.bins:
            return t
        flat = t.reshape(-1, 1, n)
        return torch.nn.functional.adaptive_avg_pool1d(flat, probe.bins).reshape(
            *t.shape[:-1], probe.bins)
    values, indices = t.topk(min(probe.k, t.shape[-1]), dim=-1)
    return {"values": values, "indices": indices}


class Scope:
    """Watches and perturbs the internals of this rank's model chunks (see
    the module docstring). Every rank of the job creates one with the same
    calls in the same order."""

    def __init__(self, chunks, parallel_state=None):
        from ..tensor_parallel.utils import resolve_state

        self.chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        self.state = resolve_state(parallel_state)
        first = self.chunks[0]
        self.model_config = getattr(first, "module", first).config
        self.probes: dict[str, Probe] = {}
        self.perturbations: list[Perturbation] = []
        self.log: list[dict] = []  #: {"step", "perturbation"} per perturbed step
        self.step_count = 0
        self.training = False  #: weights perturbations are permanent edits in training
        self._records: dict = {}
        self._ids = itertools.count(1)
        self._saved_weights: dict = {}  # perturbation id -> [(param, original)]
        self._touched: set = set()

    # ---- configuration (same calls on every rank) -------------------------
    def _check_layers(self, layers, site):
        if layers is None:
            return None
        if isinstance(layers, int):
            layers = [layers]
        n = self.model_config.num_layers
        top = n if site == "logits" else n - 1
        for i in layers:
            _check_int(f"{site}: layer", i, 0, top)
        return sorted(set(layers))

    def watch(self, site: str, layers=None, *, reduce: str = "bins", bins: int = 64,
              dim: int = -1, k: int = 5, sample: int = 0) -> None:
        """Record `site` at `layers` (None: all) from the next step on."""
        sites = ("query", "key", "value") if site == "qkv" else (site,)
        for s in sites:
            if s not in SITES:
                raise ScopeError(f"unknown site {s!r}: expected one of {', '.join(SITES)} "
                                 "(or qkv)")
        if reduce not in REDUCERS:
            raise ScopeError(f"unknown reducer {reduce!r}: expected one of {', '.join(REDUCERS)}")
        _check_int("bins", bins, 1, 4096)
        _check_int("k", k, 1, 1024)
        _check_int("sample", sample, 0)
        _check_int("dim", dim, -8, 7)
        if site in HEAD_SITES + ("qkv",) and reduce in ("mean", "max", "absmax") \
                and dim in (0, -3):
            raise ScopeError(f"{site}: dim {dim} is the head axis (values are [heads, seq, "
                             "...] per sample); reduce over dim -1 or -2 instead")
        for s in sites:
            self.probes[s] = Probe(s, self._check_layers(layers, s), reduce, bins, dim, k, sample)

    def unwatch(self, site: str | None = None) -> None:
        if site is None:
            self.probes.clear()
        else:
            for s in (("query", "key", "value") if site == "qkv" else (site,)):
                self.probes.pop(s, None)

    def perturb(self, site: str, kind: str, layers=None, *, std: float = 0.0,
                scale: float = 0.0, bit: int = 0, fraction: float = 1.0, head: int = 0,
                name: str | None = None, steps: int | None = 1, seed: int = 0) -> int:
        """Arms a perturbation for the next `steps` steps (None: until
        cleared); returns its id. Weights are edited right away."""
        check_perturbation(site, kind)
        if kind == "zero_head":
            if site not in HEAD_SITES:
                raise ScopeError(f"zero_head needs a site with heads ({', '.join(HEAD_SITES)}), "
                                 f"not {site!r}")
            _check_int("head", head, 0, self.model_config.num_attention_heads - 1)
        _check_float("std", std)
        _check_float("scale", scale)
        _check_float("fraction", fraction)
        if fraction > 1:
            raise ScopeError(f"fraction must be in [0, 1], got {fraction}")
        _check_int("bit", bit, 0, 31)
        _check_int("seed", seed, 0)
        if steps is not None:
            _check_int("steps", steps, 1)
        p = Perturbation(site, kind, None, std, scale, bit, fraction, head, name, steps, seed,
                         next(self._ids))
        if site == "weights":
            self._perturb_weights(p)
        else:
            p.layers = self._check_layers(layers, site)
        self.perturbations.append(p)
        return p.id

    def clear_perturbations(self, restore_weights: bool | None = None) -> None:
        """Disarms every perturbation; weights edited outside training get
        their original values back (``restore_weights`` overrides)."""
        for p in list(self.perturbations):
            self._expire(p, restore_weights)

    # ---- one step ---------------------------------------------------------
    @contextlib.contextmanager
    def step(self):
        """One forward pass (generation) or training step: taps are live
        inside; perturbation lifetimes count these."""
        previous = self.begin_step()
        try:
            yield self
        finally:
            self.end_step(previous)

    def begin_step(self):
        """Opens a step (what :meth:`step` does on entry); returns the scope
        that was active, for :meth:`end_step`."""
        self._records = {}
        self._touched = set()
        previous = taps.ACTIVE
        if self.probes or any(p.site != "weights" for p in self.perturbations):
            taps.ACTIVE = self
        return previous

    def end_step(self, previous=None) -> None:
        taps.ACTIVE = previous
        applied = [p for p in self.perturbations if p.site == "weights" or p.id in self._touched]
        if applied:
            self.log.append({"step": self.step_count,
                             "perturbation": "; ".join(p.describe() for p in applied)})
        for p in list(self.perturbations):
            if p.site == "weights" or p.id in self._touched:
                p.applied.append(self.step_count)
            if p.steps is not None and len(p.applied) >= p.steps:
                self._expire(p, None)
        self.step_count += 1

    def perturbed_last_step(self) -> str | None:
        if self.log and self.log[-1]["step"] == self.step_count - 1:
            return self.log[-1]["perturbation"]
        return None

    def needs_probs(self, layer: int) -> bool:
        probe = self.probes.get("attn_probs")
        if probe is not None and (probe.layers is None or layer in probe.layers):
            return True
        return any(p.site == "attn_probs" and (p.layers is None or layer in p.layers)
                   for p in self.perturbations)

    # ---- the tap (called by the model) -----------------------------------
    def tap(self, site: str, layer: int, x: torch.Tensor, kind: str) -> torch.Tensor:
        for p in self.perturbations:
            if p.site == site and (p.layers is None or layer in p.layers):
                x = self._apply(p, layer, x, kind)
                self._touched.add(p.id)
        probe = self.probes.get(site)
        if probe is not None and (probe.layers is None or layer in probe.layers) \
                and (site, layer) not in self._records:  # first microbatch; not the recompute
            self._records[(site, layer)] = self._observe(probe, x, kind)
        return x

    def _observe(self, probe: Probe, x: torch.Tensor, kind: str):
        from ..tensor_parallel import mappings

        st = self.state
        x = x.detach()
        with torch.no_grad():
            if kind in ("seq", "replicated", "vocab"):
                if kind == "seq" and st.tp_size > 1:
                    x = mappings.gather_from_sequence_parallel_region(x, False, st.tensor_group)
                if kind == "vocab" and st.tp_size > 1:
                    x = mappings.gather_from_tensor_model_parallel_region(x, st.tensor_group)
                x = x.transpose(0, 1)  # [b, s, ...]
                if st.tp_rank != 0:
                    return None  # tp rank 0 speaks for the (now identical) tensor group
            if not 0 <= probe.sample < x.shape[0]:
                raise ScopeError(f"{probe.site}: sample {probe.sample} out of range for a batch "
                                 f"of {x.shape[0]}")
            out = reduce_tensor(x[probe.sample].float(), probe)
        if isinstance(out, dict):
            return {k: v.cpu() for k, v in out.items()}
        return out.cpu()

    # ---- perturbation kernels --------------------------------------------
    def _generator(self, p: Perturbation, site: str, layer: int) -> torch.Generator:
        key = f"{p.seed}/{site}/{layer}/{self.step_count}".encode()
        return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:7],
                                                            "little"))

    def _global_view(self, x: torch.Tensor, kind: str):
        """(global shape, slices of this rank's part) of a local activation."""
        st = self.state
        shape = list(x.shape)
        dim = {"heads": 1, "seq": 0, "vocab": -1}.get(kind)
        if dim is None or st.tp_size == 1:
            return shape, None
        n = shape[dim]
        shape[dim] = n * st.tp_size
        idx = [slice(None)] * len(shape)
        idx[dim] = slice(st.tp_rank * n, (st.tp_rank + 1) * n)
        return shape, tuple(idx)

    def _noise(self, p, site, layer, x, shape, idx):
        g = self._generator(p, site, layer)
        if p.kind == "gaussian":
            full = torch.randn(shape, generator=g) * p.std
        elif p.kind == "uniform":
            full = torch.rand(shape, generator=g) * 2 - 1
        else:  # bitflip mask
            full = torch.rand(shape, generator=g) < p.fraction
        part = full if idx is None else full[idx]
        return part.to(x.device)

    def _apply(self, p: Perturbation, layer: int, x: torch.Tensor, kind: str) -> torch.Tensor:
        if p.kind == "zero_head":
            local = self.model_config.num_attention_heads // self.state.tp_size
            h = p.head - self.state.tp_rank * local
            if 0 <= h < local:
                mask = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
                mask[h] = 0
                x = x * mask.view(1, -1, *([1] * (x.dim() - 2)))
            return x
        shape, idx = self._global_view(x, kind)
        noise = self._noise(p, p.site, layer, x, shape, idx)
        return _combine(p, x, noise)

    def _perturb_weights(self, p: Perturbation) -> None:
        from ..checkpoint import global_named_parameters, tensor_parallel_slice

        if not p.name:
            raise ScopeError("a weights perturbation needs name= (a parameter's global name, "
                             "e.g. layers.0.mlp.fc1.weight)")
        if p.kind == "zero_head":
            raise ScopeError("zero_head applies to attention sites, not weights")
        params = global_named_parameters(self.chunks)
        if p.name not in params and not self._owned_elsewhere(p.name):
            sample = ", ".join(sorted(params)[:4])
            raise ScopeError(f"unknown parameter {p.name!r} (names look like: {sample}, ...)")
        saved = []
        if p.name in params:
            param = params[p.name]
            sl = tensor_parallel_slice(param, self.state)
            shape = list(param.shape)
            idx = None
            if sl is not None:
                d, a, b = sl
                shape[d] *= self.state.tp_size
                idx = [slice(None)] * len(shape)
                idx[d] = slice(a, b)
                idx = tuple(idx)
            with torch.no_grad():
                noise = self._noise(p, "weights", 0, param, shape, idx)
                saved.append((param, param.detach().clone()))
                param.copy_(_combine(p, param.detach(), noise))
        self._saved_weights[p.id] = saved

    def _owned_elsewhere(self, name: str) -> bool:
        """A layer held by another pipeline stage: its owner perturbs it."""
        parts = name.split(".")
        return len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() \
            and int(parts[1]) < self.model_config.num_layers

    def _expire(self, p: Perturbation, restore: bool | None) -> None:
        self.perturbations.remove(p)
        saved = self._saved_weights.pop(p.id, [])
        if restore if restore is not None else not self.training:
            with torch.no_grad():
                for param, original in saved:
                    param.copy_(original)

    # ---- results ----------------------------------------------------------
    def records(self) -> dict:
        """This rank's records of the last step: {(site, layer): value}."""
        return {k: v for k, v in self._records.items() if v is not None}

    def collect(self, dst: int = 0) -> dict | None:
        """Collective over the world: every stage's records of the last step,
        merged on `dst` as {site: {layer: tensor or {"values", "indices"}}}
        (None elsewhere). Data-parallel replicas other than the first do not
        send."""
        st = self.state
        mine = self.records() if st.dp_rank == 0 and st.cp_rank == 0 else {}
        payload = (st.tp_rank, mine)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
            dist.gather_object(payload, gathered, dst=dst)
            if dist.get_rank() != dst:
                return None
        else:
            gathered = [payload]
        return _merge(gathered)


def _combine(p: Perturbation, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    if p.kind == "gaussian":
        return x + noise.to(x.dtype)
    if p.kind == "uniform":
        return x * (1 + p.scale * noise).to(x.dtype)
    # bitflip in the value's own representation
    bits = {torch.float32: (torch.int32, 31), torch.bfloat16: (torch.int16, 15),
            torch.float16: (torch.int16, 15)}.get(x.dtype)
    if bits is None:
        raise ScopeError(f"bitflip supports fp32, bf16 and fp16 values, not {x.dtype}")
    itype, top = bits
    if p.bit > top:
        raise ScopeError(f"bit {p.bit} is outside a {x.dtype} value (bits 0-{top})")
    flip = torch.tensor(1 << p.bit if p.bit < top else -(1 << top), dtype=itype)
    raw = x.contiguous().view(itype)
    return torch.where(noise, raw ^ flip.to(x.device), raw).view(x.dtype)


def _merge(gathered) -> dict:
    heads: dict = {}
    out: dict = {}
    for tp_rank, recs in gathered:
        for (site, layer), v in recs.items():
            if site in HEAD_SITES:
                heads.setdefault((site, layer), []).append((tp_rank, v))
            else:
                out.setdefault(site, {})[layer] = v
    for (site, layer), parts in heads.items():
        parts.sort(key=lambda t: t[0])
        vals = [v for _, v in parts]
        if isinstance(vals[0], dict):
            merged = {k: torch.cat([v[k] for v in vals]) for k in vals[0]}
        else:
            merged = torch.cat(vals)
        out.setdefault(site, {})[layer] = merged
    return out
