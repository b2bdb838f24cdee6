"""Tensor files: safetensors with a CRC-32 per tensor, written and read by
the C++ file engine (``include/mapp/torch/checkpoint_engine.h``, the one
implementation the C++ trainers use too).

Files are plain safetensors (readable by any safetensors reader). On top of
the format, every tensor carries a CRC-32 of its bytes in the metadata
(``__metadata__["crc32"]``, a JSON object); :func:`read` verifies it, so a
flipped byte anywhere in the data is caught, not only a broken header. Any
file the engine cannot parse (truncated, not safetensors, a malformed
header) becomes a :class:`CheckpointError` naming the file. Files written by
megatronapp's earlier writers are valid safetensors with the same metadata
and read unchanged (tested).
"""

from __future__ import annotations

import contextlib
import json
import os

from .. import _C

__all__ = ["write", "read", "CheckpointError", "fsync_dir"]


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be used (names what and why)."""


@contextlib.contextmanager
def engine_errors():
    """The engine's ValueErrors (file and tensor named) as CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def write(path: str, tensors: dict, metadata: dict | None = None) -> int:
    """Writes `tensors` ({name: tensor}, any device or layout) to `path` and
    fsyncs it; returns the bytes written. Metadata values that are not
    strings are stored as JSON."""
    meta = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in (metadata or {}).items()]
    with engine_errors():
        return _C.checkpoint_write_safetensors(path, [(n, t.detach()) for n, t in tensors.items()],
                                               meta)


def read(path: str, names=None) -> tuple[dict, dict]:
    """({name: tensor}, metadata) of `path` (only `names` if given), checked."""
    with engine_errors():
        f = _C.CheckpointTensorFile(path)
        keys = f.keys()
        if names is not None:
            stored = set(keys)
            missing = [k for k in names if k not in stored]
            if missing:
                raise CheckpointError(f"{path}: no tensor(s) {missing[:5]} in this file")
            keys = list(names)
        return {k: f.tensor(k) for k in keys}, dict(f.metadata)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
