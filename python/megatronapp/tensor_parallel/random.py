"""Tracked RNG states and activation recomputation (Megatron's
``tensor_parallel.random``: RNG tracker, ``model_parallel_cuda_manual_seed``,
``checkpoint``).

Dropout needs two kinds of randomness under tensor parallelism:

* on activations every tensor rank holds whole (the residual stream without
  sequence parallelism), the masks must agree across the tensor group: the
  default generator, seeded alike on every tensor rank;
* on activations the tensor ranks hold different parts of (attention
  probabilities of their own heads; the residual stream's sequence shard
  under sequence parallelism), the masks must differ: a named state of the
  :class:`RNGStatesTracker`, seeded per tensor rank, entered with
  ``get_rng_tracker().fork()``.

:func:`checkpoint` runs a region without keeping its activations and runs it
again in backward. It saves every RNG state the region can draw from (the
default generator of the tracker's device and all tracked states) before the
forward and restores them for the recompute, so dropout draws the same masks
both times; afterwards the states continue from where the forward pass left
them, as if nothing had been recomputed.

The recompute calls ``torch.autograd.backward`` inside the backward pass (a
re-entrant checkpoint, as Megatron's ``CheckpointFunction``), so deferred
weight gradients (:mod:`megatronapp.autograd`, the zero-bubble BI/W split)
and data-parallel gradient hooks work inside a recomputed region unchanged.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

import torch

from .. import _collectives, packed_sequence

__all__ = [
    "check_recompute",
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "get_rng_tracker",
    "get_cuda_rng_tracker",
    "model_parallel_seed",
    "model_parallel_cuda_manual_seed",
    "checkpoint",
    "dropout",
]

#: The tracked state of dropout on tensor-sharded activations (Megatron's name).
MODEL_PARALLEL_RNG = "model-parallel-rng"

#: Offset of the tensor-parallel seed from the base seed (Megatron's constant,
#: so that a seed means the same masks here and there).
_TP_SEED_OFFSET = 2718


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states of one device type (``"cpu"`` or ``"cuda"``,
    the current CUDA device). ``fork(name)`` swaps the named state into the
    device's default generator for the body and saves it back after, so the
    default sequence is untouched by what the body draws."""

    def __init__(self, device_type: str = "cpu") -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"RNGStatesTracker: device_type must be 'cpu' or 'cuda', "
                             f"got {device_type!r}")
        self.device_type = device_type
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self, device_type: str | None = None) -> None:
        self.states.clear()
        self.seeds.clear()
        if device_type is not None:
            self.__init__(device_type)

    def is_initialized(self) -> bool:
        return bool(self.states)

    def get_states(self) -> dict:
        """A copy of every named state (what :func:`checkpoint` saves)."""
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed`; both must be new (two
        regions on one seed would draw correlated masks)."""
        if seed in self.seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used")
        if name in self.states:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds.add(seed)
        saved = _get_state(self.device_type)
        try:
            if self.device_type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states[name] = _get_state(self.device_type)
        finally:
            _set_state(self.device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draws inside come from state `name`, which then advances."""
        if name not in self.states:
            raise RuntimeError(
                f"RNG tracker: no state {name!r}; seed the tracker first with "
                f"megatronapp.tensor_parallel.model_parallel_seed(seed) (pretrain does)")
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


_TRACKER = RNGStatesTracker("cpu")


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (seeded by :func:`model_parallel_seed`)."""
    return _TRACKER


#: Megatron's name for :func:`get_rng_tracker`.
get_cuda_rng_tracker = get_rng_tracker


def model_parallel_seed(seed: int, parallel_state=None, device_type: str | None = None) -> None:
    """Seeds dropout for tensor parallelism (Megatron's
    ``model_parallel_cuda_manual_seed``): the default generator of
    `device_type` with `seed` (identical masks across the tensor group) and
    the tracker's :data:`MODEL_PARALLEL_RNG` with ``seed + 2718 + tp_rank``
    (distinct masks per tensor rank). Callers that want different masks per
    pipeline stage offset `seed` by stage, as Megatron's initialize does
    (``seed + 100 * pp_rank``). `device_type` defaults to ``"cuda"`` when CUDA
    is available."""
    from .utils import resolve_state

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    tp_rank = resolve_state(parallel_state).tp_rank
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset(device_type)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


#: Megatron's name for :func:`model_parallel_seed`.
def model_parallel_cuda_manual_seed(seed: int, parallel_state=None) -> None:
    model_parallel_seed(seed, parallel_state)


# ---- dropout --------------------------------------------------------------------------


class _FusedDropout(torch.autograd.Function):
    """CPU dropout whose mask is a function of (seed, element index): the
    forward draws one seed, the backward regenerates the mask from it, so no
    mask is kept (``torch.ops.mapp.fused_dropout``; mapp/tp/dropout.h)."""

    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.p, ctx.seed = p, seed
        return torch.ops.mapp.fused_dropout(x, p, seed)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.mapp.fused_dropout(grad, ctx.p, ctx.seed), None, None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)`` drawing from the current generator (so a
    tracker fork and :func:`checkpoint`'s replay apply). On CPU a fused
    counter-based kernel: one seed drawn per call, about 10x faster than
    torch's CPU Bernoulli, and no mask kept for backward; the drop probability
    is p rounded to 1/65536 and kept values scale so the mean is exact. On
    CUDA, torch's fused dropout."""
    if not training or p == 0.0:
        return x
    check_dropout_probability(p)
    if x.device.type != "cpu":
        return torch.nn.functional.dropout(x, p, True)
    return _FusedDropout.apply(x, p, draw_seed())


def check_dropout_probability(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")


def draw_seed() -> int:
    """One seed for a counter-based dropout mask, drawn from the current
    generator (so tracker forks and checkpoint replays govern it)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))


# ---- activation recomputation ------------------------------------------------------


def _capture(device_type: str) -> tuple:
    return _get_state(device_type), _TRACKER.get_states()


def _restore(device_type: str, states: tuple) -> None:
    _set_state(device_type, states[0])
    _TRACKER.set_states(states[1])


class _Checkpoint(torch.autograd.Function):
    """Forward without a graph, keeping the inputs (the first one sharded
    over `group` when distributed) and the RNG states; backward restores the
    states, runs the function again with a graph and back-propagates through
    it."""

    @staticmethod
    def forward(ctx, run_function, group, *args):
        ctx.run_function, ctx.group = run_function, group
        ctx.device_type = _TRACKER.device_type
        ctx.rng = _capture(ctx.device_type)
        ctx.packed = packed_sequence.current()  # the microbatch's documents, for the recompute
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        saved = [args[i] for i in ctx.tensor_at]
        ctx.first_shape = None
        if group is not None and saved:
            # Keep 1/tp of the first input: every tensor rank holds it whole.
            ctx.first_shape = saved[0].shape
            flat = saved[0].detach().reshape(-1)
            n = _collectives.group_size(group)
            if flat.numel() % n:
                raise ValueError(f"distribute_saved_activations: {flat.numel()} elements do "
                                 f"not split over {n} tensor ranks")
            saved[0] = flat.chunk(n)[dist.get_rank(group)].clone()
        ctx.save_for_backward(*saved)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = list(ctx.saved_tensors)
        if ctx.first_shape is not None:
            saved[0] = _collectives.all_gather(saved[0], 0, ctx.group).view(ctx.first_shape)
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, saved, strict=True):
            args[i] = t.detach().requires_grad_(ctx.needs_input_grad[2 + i])
        after = _capture(ctx.device_type)
        _restore(ctx.device_type, ctx.rng)
        try:
            with torch.enable_grad(), packed_sequence.active(ctx.packed):
                outputs = ctx.run_function(*args)
        finally:
            _restore(ctx.device_type, after)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [None] * len(args)
        for i in ctx.tensor_at:
            grads[i] = args[i].grad
        return (None, None, *grads)


def checkpoint(function, distribute_saved_activations: bool, *args, group=None):
    """``function(*args)`` without keeping its activations: they are computed
    again in backward, from the same RNG states (Megatron's signature).

    With `distribute_saved_activations`, the first argument (which every rank
    of the tensor `group` must hold whole: not under sequence parallelism) is
    kept as 1/tp per rank and all-gathered for the recompute. Outside autograd
    (no grad mode, or no input that needs a gradient — the parameters inside
    would get none from a re-entrant checkpoint) the function just runs."""
    if not torch.is_grad_enabled() or not any(
            torch.is_tensor(a) and a.requires_grad for a in args):
        return function(*args)
    if distribute_saved_activations:
        from .utils import tensor_group_of

        group = group if group is not None else tensor_group_of(None)
        if _collectives.group_size(group) == 1:
            group = None
    else:
        group = None
    return _Checkpoint.apply(function, group, *args)


def check_recompute(granularity, method, num_layers, distribute=False,
                    sequence_parallel=False) -> None:
    """Megatron's rules for the recomputation flags; ValueError naming the flag."""
    if granularity not in (None, "selective", "full"):
        raise ValueError(f"--recompute-granularity {granularity!r}: expected selective or full")
    if granularity == "full":
        if method not in ("uniform", "block"):
            raise ValueError("--recompute-granularity full needs --recompute-method uniform "
                             "or block")
        if num_layers is None or num_layers < 1:
            raise ValueError("--recompute-granularity full needs --recompute-num-layers N "
                             "(N >= 1): layers per recomputed group (uniform) or the first N "
                             "layers of each stage (block)")
    elif method is not None:
        raise ValueError(f"--recompute-method {method} applies only to "
                         "--recompute-granularity full")
    if distribute and granularity != "full":
        raise ValueError("--distribute-saved-activations needs --recompute-granularity full")
    if distribute and sequence_parallel:
        raise ValueError("--distribute-saved-activations does not combine with "
                         "--sequence-parallel (the layer inputs are already sharded)")
