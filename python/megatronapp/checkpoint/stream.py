"""Streaming checkpoint reads: each rank reads exactly the byte ranges of the
stored pieces that overlap its slices, straight into its tensors.

The reads are the C++ file engine's (``mapp::CheckpointLoader`` in
``include/mapp/torch/checkpoint_engine.h``, which the C++ trainers load
with too); this module keeps the Python names. No global tensor is ever
assembled. A stored piece is a flat range of one tensor-parallel region of a
global tensor (``tp_slice`` + ``flat`` in metadata.json); a destination (this
rank's parameter shard, or its ZeRO-1 flat range of it) is the same kind of
object. Both flat ranges decompose into a few boxes that are contiguous in
memory; the intersection of two boxes is a box, read from the file with
positioned reads (the file's bytes of the box's span, in chunks of at most
``budget`` bytes) and copied into the destination's strided view. When a
destination box is the stored box itself, contiguous and of the stored dtype
(loading under the saving layout), the bytes are read straight into the
destination's memory: no intermediate buffer at all.

Verification: every stored piece this rank reads is checked against its
CRC-32, computed on the destination memory when the piece landed there whole,
otherwise by streaming the piece once more in `budget`-sized chunks (from the
page cache). Pieces this rank does not need are neither read nor checked. The
reads, copies and checks run on the engine's thread pool, without the GIL.
``verify=False`` skips the checks: faster, and a flipped bit in the file then
goes unnoticed.

Peak host memory beyond the destination tensors is `budget` per worker
thread, whatever the size of the global tensors.
"""

from __future__ import annotations

import json

import torch

from .. import _C
from .format import CheckpointError, engine_errors

__all__ = ["TensorFile", "StreamLoader", "DEFAULT_BUDGET"]

#: Largest read buffer one worker holds (bytes).
DEFAULT_BUDGET = 64 << 20


class TensorFile:
    """A safetensors file opened for positioned reads (header parsed and
    checked by the engine: offsets inside the file, sizes matching shapes)."""

    def __init__(self, path: str):
        self.path = path
        with engine_errors():
            self._f = _C.CheckpointTensorFile(path)
        self.metadata = dict(self._f.metadata)
        self.entries = {}
        for key in self._f.keys():
            dtype, shape, offset, nbytes = self._f.entry(key)
            self.entries[key] = (dtype, list(shape), offset, nbytes)

    def close(self) -> None:
        self._f = None

    def entry(self, key: str):
        if key not in self.entries:
            raise CheckpointError(f"{self.path}: no tensor '{key}' in this file")
        return self.entries[key]

    def tensor(self, key: str, verify: bool = True) -> torch.Tensor:
        self.entry(key)
        with engine_errors():
            return self._f.tensor(key, verify)


class StreamLoader:
    """Plans and runs the reads of one checkpoint on the engine's threads.

    ``into(name, kind, dest, tp_slice, want_shape, flat=None)`` queues filling
    `dest` (this rank's region of global tensor `name`, or the flat range
    `flat` of it) from the stored pieces, checking shapes and coverage at
    once; the reads start immediately. ``wait()`` returns once every queued
    read and check is done (raising the first error)."""

    def __init__(self, path: str, meta: dict, *, verify: bool = True,
                 budget: int = DEFAULT_BUDGET, threads: int | None = None):
        self.path = path
        with engine_errors():
            self._ld = _C.CheckpointLoader(path, json.dumps({"pieces": meta["pieces"]}),
                                           verify=verify, budget=int(budget),
                                           threads=int(threads or 0))

    @property
    def verify(self) -> bool:
        return self._ld.verify

    @property
    def budget(self) -> int:
        return self._ld.budget

    @budget.setter
    def budget(self, nbytes: int) -> None:
        self._ld.budget = int(nbytes)

    def has(self, name, kind) -> bool:
        return self._ld.has(name, kind)

    def kinds(self, name) -> set:
        """Every kind stored for tensor `name` (param, main, exp_avg, ...)."""
        return set(self._ld.kinds(name))

    def scalar(self, name, kind) -> torch.Tensor:
        with engine_errors():
            return self._ld.scalar(name, kind)

    def into(self, name, kind, dest: torch.Tensor, tp_slice, want_shape, flat=None) -> None:
        with engine_errors():
            self._ld.into(name, kind, dest, None if tp_slice is None else list(tp_slice),
                          list(want_shape), None if flat is None else tuple(flat))

    def done(self) -> bool:
        return self._ld.done()

    def wait_quietly(self) -> None:
        """Waits for queued work, ignoring its errors (after a planning error)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the planning error is the one reported
            pass

    def wait(self) -> None:
        with engine_errors():
            self._ld.wait()
