"""Tensor files: the safetensors layout, written and read without pickle.

    8 bytes   little-endian u64 N: header length
    N bytes   JSON: {name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]},
                     "__metadata__": {"crc32": "{name: crc, ...}", ...}}
    ...       the tensors' raw bytes, back to back (offsets relative to here)

Files are readable by the ``safetensors`` library. Every tensor carries a
CRC-32 of its bytes in the metadata; ``read`` verifies it and rejects a
truncated file, a flipped byte, an unknown dtype, a shape that does not match
the byte count, or overlapping offsets with an error naming the file and the
tensor.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np

import torch

__all__ = ["write", "read", "CheckpointError", "fsync_dir"]

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_TORCH = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be used (names what and why)."""


def _bytes_of(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write(path: str, tensors: dict, metadata: dict | None = None) -> int:
    """Writes `tensors` ({name: tensor}) to `path` and fsyncs it; returns bytes."""
    header, blobs, crcs, offset = {}, [], {}, 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {t.dtype}")
        b = _bytes_of(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        crcs[name] = zlib.crc32(b)
        blobs.append(b)
        offset += len(b)
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    meta["crc32"] = json.dumps(crcs)
    header["__metadata__"] = meta
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # align the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(h) + offset


def read(path: str, names=None) -> tuple[dict, dict]:
    """({name: tensor}, metadata) of `path` (only `names` if given), checked."""
    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open checkpoint file: {e.strerror}") from None
    with f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated (no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} is impossible for a file of {size} "
                                  "bytes (truncated or not a checkpoint file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header must be a JSON object")
        meta = header.pop("__metadata__", {})
        try:
            crcs = json.loads(meta.get("crc32", "{}"))
        except json.JSONDecodeError:
            raise CheckpointError(f"{path}: malformed crc32 metadata") from None
        data_start, data_size = 8 + n, size - 8 - n
        wanted = header if names is None else {k: header[k] for k in names if k in header}
        if names is not None:
            missing = [k for k in names if k not in header]
            if missing:
                raise CheckpointError(f"{path}: no tensor(s) {missing[:5]} in this file")
        out = {}
        for name, info in wanted.items():
            try:
                dtype = _TORCH[info["dtype"]]
                shape = [int(x) for x in info["shape"]]
                b, e = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry "
                                      f"{info!r}") from None
            itemsize = torch.empty((), dtype=dtype).element_size()
            if any(s < 0 for s in shape) or not 0 <= b <= e <= data_size:
                raise CheckpointError(f"{path}: tensor '{name}' lies outside the file "
                                      f"(offsets {b}..{e}, data {data_size} bytes: truncated?)")
            if int(np.prod(shape, dtype=np.int64)) * itemsize != e - b:
                raise CheckpointError(f"{path}: tensor '{name}' has shape {shape} ({info['dtype']})"
                                      f" but {e - b} bytes")
            f.seek(data_start + b)
            blob = bytearray(e - b)  # read straight into the tensor's memory
            if f.readinto(blob) != e - b:
                raise CheckpointError(f"{path}: tensor '{name}' is truncated")
            if name in crcs and zlib.crc32(blob) != crcs[name]:
                raise CheckpointError(f"{path}: checksum mismatch in tensor '{name}' (the file is "
                                      "corrupted)")
            out[name] = (torch.frombuffer(blob, dtype=torch.uint8).view(dtype).reshape(shape)
                         if blob else torch.empty(shape, dtype=dtype))
    return out, meta


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
