"""Tensor files: safetensors, through the ``safetensors`` package, plus a
CRC-32 per tensor.

Files are plain safetensors (readable by any safetensors reader). On top of
the format, every tensor carries a CRC-32 of its bytes in the metadata
(``__metadata__["crc32"]``, a JSON object); :func:`read` verifies it, so a
flipped byte anywhere in the data is caught, not only a broken header. Any
file the library cannot parse (truncated, not safetensors, a malformed
header) becomes a :class:`CheckpointError` naming the file. Files written by
megatronapp's earlier hand-written writer (format 1) are valid safetensors
with the same metadata and read unchanged (tested).
"""

from __future__ import annotations

import json
import os
import zlib

from safetensors import SafetensorError, safe_open
from safetensors.torch import save as _st_save

import torch

__all__ = ["write", "read", "CheckpointError", "fsync_dir"]


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be used (names what and why)."""


def _crc(t: torch.Tensor) -> int:
    t = t.detach().contiguous().cpu()
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0


def write(path: str, tensors: dict, metadata: dict | None = None) -> int:
    """Writes `tensors` ({name: tensor}) to `path` and fsyncs it; returns bytes."""
    host = {}
    for name, t in tensors.items():
        # Contiguous CPU tensors that own their storage: safetensors refuses
        # tensors sharing memory (ZeRO-1 parameters are views into one bucket
        # buffer). Host copies made for an asynchronous save are used as they are.
        t = t.detach()
        owns = (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.nbytes)
        host[name] = t if owns else t.to("cpu", copy=True).contiguous()
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    meta["crc32"] = json.dumps({name: _crc(t) for name, t in host.items()})
    try:
        blob = _st_save(host, metadata=meta)
    except (SafetensorError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot serialize the tensors ({e})") from None
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    return len(blob)


def read(path: str, names=None) -> tuple[dict, dict]:
    """({name: tensor}, metadata) of `path` (only `names` if given), checked."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: cannot open checkpoint file: no such file")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
            if names is not None:
                missing = [k for k in names if k not in keys]
                if missing:
                    raise CheckpointError(f"{path}: no tensor(s) {missing[:5]} in this file")
                keys = list(names)
            out = {k: f.get_tensor(k) for k in keys}
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or "
                              f"corrupted: {e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open checkpoint file: {e.strerror}") from None
    try:
        crcs = json.loads(meta.get("crc32", "{}"))
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}: malformed crc32 metadata") from None
    for name, t in out.items():
        if name in crcs and _crc(t) != crcs[name]:
            raise CheckpointError(f"{path}: checksum mismatch in tensor '{name}' (the file is "
                                  "corrupted)")
    return out, meta


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
