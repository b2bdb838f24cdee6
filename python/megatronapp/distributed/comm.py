"""Compressed collectives for users outside DDP (the same C++ code DDP uses).

    import megatronapp as mapp
    mapp.comm.all_reduce(grad, compression="int8")            # mean over WORLD
    reducer = mapp.comm.CompressedAllReduce("onebit", numel=grad.numel())
    reducer(grad)                                             # keeps error feedback

Codec specs: ``none``, ``bf16``, ``fp16``, ``int8[:block]``, ``onebit[:block]``,
``topk:<ratio>``, ``powersgd:<rank>`` (docs/data_parallel.md). Biased codecs
(int8, onebit, topk, powersgd) need error feedback to converge: use a
:class:`CompressedAllReduce` (or DDP), which keeps the residuals between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

import torch

from .. import _C  # noqa: F401  (registers torch.ops.mapp)

__all__ = ["Compression", "parse_compression", "CompressedAllReduce", "all_reduce",
           "reduce_scatter", "codec_state", "wait"]


@dataclass(frozen=True)
class Compression:
    """A codec spec plus a warm-up: the first `start_iter` reductions run
    uncompressed (as PowerSGD and 1-bit Adam recommend)."""

    spec: str
    start_iter: int = 0

    def __post_init__(self):
        # The C++ parser is the single source of truth; it lists valid specs.
        torch.ops.mapp.codec_state_shapes(self.spec, 1, 1, [])
        if self.start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {self.start_iter}")

    @property
    def kind(self) -> str:
        return self.spec.split(":")[0]


def parse_compression(value: None | str | Compression) -> Compression | None:
    """None / "none" -> None; a spec string or a Compression -> Compression."""
    if value is None or value == "none":
        return None
    if isinstance(value, Compression):
        return value
    if isinstance(value, str):
        return Compression(value)
    raise ValueError(f"compression must be a spec string or a Compression, got {value!r}")


def codec_state(spec: str, numel: int, world: int = 1, layout: list | None = None,
                device=None, seed: int = 0) -> list:
    """Fresh state tensors of a codec for a `numel` buffer over `world` ranks
    (``torch.ops.mapp.codec_state``): zero error-feedback residuals, and
    PowerSGD's Q drawn from `seed` (identical on every rank). `layout` lists
    the flattened (offset, rows, cols) of the matrices in the buffer; codecs
    other than PowerSGD ignore it."""
    return torch.ops.mapp.codec_state(spec, numel, world, list(layout or []), seed,
                                      torch.device(device) if device is not None else None)


class CompressedAllReduce:
    """A compressed all-reduce of a fixed-size buffer with persistent state
    (error-feedback residuals, PowerSGD's warm-started Q).

    `layout` lists (offset, rows, cols) of the matrices inside the buffer
    (PowerSGD compresses those and sends the rest uncompressed)."""

    def __init__(self, compression, *, numel: int, group: dist.ProcessGroup | None = None,
                 layout: list | None = None, device=None, seed: int = 0):
        self.compression = parse_compression(compression)
        self.group = group if group is not None else dist.group.WORLD
        self.numel = numel
        self.layout = [int(v) for triple in (layout or []) for v in triple]
        self.calls = 0
        spec = self.compression.spec if self.compression else "none"
        self.state = codec_state(spec, numel, self.group.size(), self.layout,
                                    device or "cpu", seed)

    @property
    def spec(self) -> str:
        c = self.compression
        if c is None or self.calls < c.start_iter:
            return "none"
        return c.spec

    def _args(self, flat):
        if flat.numel() != self.numel:
            raise ValueError(f"buffer has {flat.numel()} elements, reducer was built for "
                             f"{self.numel}")
        spec = self.spec
        state = self.state if spec != "none" else []
        return spec, state

    def __call__(self, tensor: torch.Tensor, *, average: bool = True) -> dict:
        """Reduces `tensor` (contiguous) in place; returns {raw_bytes, sent_bytes}."""
        flat = tensor.view(-1)
        spec, state = self._args(flat)
        raw, sent = torch.ops.mapp.compressed_all_reduce_(
            flat, spec, state, self.layout, average, self.group.group_name)
        self.calls += 1
        return {"raw_bytes": raw, "sent_bytes": sent}

    def start(self, tensor: torch.Tensor, *, average: bool = True):
        """Asynchronous version: returns a ``CommWork`` (``work.is_completed()``,
        ``work.wait(timeout_ms)``; or :func:`wait`). Do not touch `tensor`
        until it is waited for."""
        flat = tensor.view(-1)
        spec, state = self._args(flat)
        work = torch.ops.mapp.compressed_all_reduce_async(
            flat, spec, state, self.layout, average, self.group.group_name)
        self.calls += 1
        return work


def wait(work, timeout: float | None = None) -> dict:
    """Waits for a ``CommWork`` at most `timeout` seconds (default
    MAPP_COLLECTIVE_TIMEOUT_S; then an error naming the operation, group and
    job); returns {raw_bytes, sent_bytes}. On CUDA the caller's current stream
    is ordered after the work, so its results are safe to use there."""
    raw, sent = work.wait(-1 if timeout is None else int(timeout * 1000))
    return {"raw_bytes": raw, "sent_bytes": sent}


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               compression=None, *, average: bool = True) -> torch.Tensor:
    """In-place (compressed) all-reduce; the mean over `group` (default WORLD)
    unless average=False. Without a persistent :class:`CompressedAllReduce`,
    error feedback starts from zero on every call."""
    if not tensor.is_contiguous():
        raise ValueError("all_reduce needs a contiguous tensor")
    CompressedAllReduce(compression, numel=tensor.numel(), group=group,
                        device=tensor.device)(tensor, average=average)
    return tensor


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                   compression=None, *, average: bool = True) -> torch.Tensor:
    """This rank's chunk of the (compressed) sum or mean of the flattened
    tensor, padded to equal chunks (the padding reduces to zeros)."""
    group = group if group is not None else dist.group.WORLD
    c = parse_compression(compression)
    spec = c.spec if c else "none"
    flat = tensor.reshape(-1)
    state = codec_state(spec, flat.numel(), group.size(), None, tensor.device)
    return torch.ops.mapp.compressed_reduce_scatter(flat, spec, state, [], average,
                                                    group.group_name)
