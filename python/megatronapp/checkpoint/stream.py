"""Streaming checkpoint reads: each rank reads exactly the byte ranges of the
stored pieces that overlap its slices, straight into its tensors.

No global tensor is ever assembled. A stored piece is a flat range of one
tensor-parallel region of a global tensor (``tp_slice`` + ``flat`` in
metadata.json); a destination (this rank's parameter shard, or its ZeRO-1
flat range of it) is the same kind of object. Both flat ranges decompose into
a few boxes that are contiguous in memory; the intersection of two boxes is a
box, read from the file with ``os.preadv`` (the file's bytes of the box's span,
in chunks of at most ``budget`` bytes) and copied into the destination's
strided view. When a destination box is the stored box itself, contiguous and
of the stored dtype (loading under the saving layout), the bytes are read
straight into the destination's memory: no intermediate buffer at all.

Verification: every stored piece this rank reads is checked against its
CRC-32, computed on the destination memory when the piece landed there whole,
otherwise by streaming the piece once more in `budget`-sized chunks (from the
page cache). Pieces this rank does not need are neither read nor checked. All
reads, copies and checks run on a thread pool (``preadv``, ``zlib.crc32`` and
tensor copies release the GIL). ``verify=False`` skips the checks: faster, and
a flipped bit in the file then goes unnoticed.

Peak host memory beyond the destination tensors is `budget` per worker
thread, whatever the size of the global tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from .format import CheckpointError

__all__ = ["TensorFile", "StreamLoader", "DEFAULT_BUDGET"]

#: Largest read buffer one worker holds (bytes).
DEFAULT_BUDGET = 64 << 20

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class TensorFile:
    """A safetensors file opened for positioned reads (header parsed and
    checked here: offsets inside the file, sizes matching shapes)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open checkpoint file: {e.strerror}") from None
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            self.close()
            raise CheckpointError(f"{path}: not a readable safetensors file (truncated: "
                                  f"{size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 1 << 30):
            self.close()
            raise CheckpointError(f"{path}: not a readable safetensors file (header of {n} "
                                  f"bytes in a file of {size}: truncated or corrupted)")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError("header is not an object")
        except (ValueError, UnicodeDecodeError) as e:
            self.close()
            raise CheckpointError(f"{path}: not a readable safetensors file (malformed "
                                  f"header: {e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        base = 8 + n
        self.entries = {}
        for key, e in header.items():
            try:
                dtype = _DTYPES[e["dtype"]]
                shape = [int(d) for d in e["shape"]]
                lo, hi = (int(x) for x in e["data_offsets"])
                numel = math.prod(shape)
                item = torch.empty((), dtype=dtype).element_size()
                ok = (min(shape, default=0) >= 0 and 0 <= lo <= hi and base + hi <= size
                      and hi - lo == numel * item)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                self.close()
                raise CheckpointError(f"{path}: tensor '{key}' has a malformed or out-of-file "
                                      "entry in the header (truncated or corrupted file)")
            self.entries[key] = (dtype, shape, base + lo, hi - lo)
        try:
            self.crcs = json.loads(self.metadata.get("crc32", "{}"))
        except json.JSONDecodeError:
            self.close()
            raise CheckpointError(f"{path}: malformed crc32 metadata") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def entry(self, key: str):
        if key not in self.entries:
            raise CheckpointError(f"{self.path}: no tensor '{key}' in this file")
        return self.entries[key]

    def read_into(self, buf: torch.Tensor, offset: int) -> None:
        """Fills the contiguous CPU tensor `buf` with the file's bytes at `offset`."""
        mv = memoryview(buf.reshape(-1).view(torch.uint8).numpy()) if buf.numel() else None
        done, want = 0, buf.numel() * buf.element_size()
        while done < want:
            got = os.preadv(self.fd, [mv[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: file ended early at byte {offset + done}")
            done += got

    def tensor(self, key: str) -> torch.Tensor:
        dtype, shape, off, _ = self.entry(key)
        t = torch.empty(shape, dtype=dtype)
        self.read_into(t, off)
        return t

    def check(self, key: str, crc: int) -> None:
        want = self.crcs.get(key)
        if want is not None and crc != want:
            raise CheckpointError(f"{self.path}: checksum mismatch in tensor '{key}' (the file "
                                  "is corrupted)")

    def crc_streamed(self, key: str, budget: int) -> int:
        _, _, off, nbytes = self.entry(key)
        buf = torch.empty(min(nbytes, budget), dtype=torch.uint8)
        crc, done = 0, 0
        while done < nbytes:
            n = min(budget, nbytes - done)
            part = buf[:n]
            self.read_into(part, off + done)
            crc = zlib.crc32(part.numpy(), crc)
            done += n
        return crc


def _crc_of(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0


# ---- geometry -------------------------------------------------------------------------------
def boxes_of(shape, lo: int, hi: int) -> list:
    """[(start, size, offset)] in `shape`'s coordinates, offsets from `lo`."""
    shape = list(shape)
    if not shape:
        return [((), (), 0)]
    out = []
    inner = math.prod(shape[1:])
    if inner == 0 or hi <= lo:
        return out
    r0, r1 = lo // inner, (hi - 1) // inner
    tail = shape[1:]
    if r0 == r1:
        if not tail:
            return [((lo,), (hi - lo,), 0)]
        return [((r0,) + s, (1,) + z, o)
                for s, z, o in boxes_of(tail, lo - r0 * inner, hi - r0 * inner)]
    first = r0
    if lo % inner:
        out += [((r0,) + s, (1,) + z, o) for s, z, o in boxes_of(tail, lo % inner, inner)]
        first = r0 + 1
    last = r1 if hi % inner == 0 else r1 - 1
    if last >= first:
        out.append(((first,) + (0,) * len(tail), (last - first + 1,) + tuple(tail),
                    first * inner - lo))
    if hi % inner:
        out += [((r1,) + s, (1,) + z, r1 * inner - lo + o)
                for s, z, o in boxes_of(tail, 0, hi - r1 * inner)]
    return out


def _region(global_shape, tp_slice):
    """(shape, offset per dim) of a tensor-parallel region in global coordinates."""
    shape = list(global_shape)
    off = [0] * len(shape)
    if tp_slice is not None:
        dim, lo, hi = tp_slice
        shape[dim], off[dim] = hi - lo, lo
    return shape, off


def _strides(shape):
    st, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        st[d] = acc
        acc *= shape[d]
    return st


# ---- loader ---------------------------------------------------------------------------------
class StreamLoader:
    """Plans and runs the reads of one checkpoint on a thread pool.

    ``into(name, kind, dest, tp_slice, flat=None)`` queues filling `dest` (this
    rank's region of global tensor `name`, or the flat range `flat` of it)
    from the stored pieces; ``wait()`` returns once every queued read and check
    is done (raising the first error)."""

    def __init__(self, path: str, meta: dict, *, verify: bool = True,
                 budget: int = DEFAULT_BUDGET, threads: int | None = None):
        self.path, self.verify, self.budget = path, verify, max(1 << 16, int(budget))
        self.by_key, self.kinds_of = {}, {}
        for pc in meta["pieces"]:
            self.by_key.setdefault((pc["name"], pc["kind"]), []).append(pc)
            self.kinds_of.setdefault(pc["name"], set()).add(pc["kind"])
        self.files, self._lock = {}, threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1),
                                       thread_name_prefix="mapp-ckpt-load")
        self.futures = []
        self.checked = set()  # pieces whose CRC was checked

    def _file(self, fname) -> TensorFile:
        with self._lock:
            if fname not in self.files:
                self.files[fname] = TensorFile(os.path.join(self.path, fname))
            return self.files[fname]

    def has(self, name, kind) -> bool:
        return (name, kind) in self.by_key

    def kinds(self, name) -> set:
        """Every kind stored for tensor `name` (param, main, exp_avg, ...)."""
        return self.kinds_of.get(name, set())

    def scalar(self, name, kind) -> torch.Tensor:
        pc = self.by_key[(name, kind)][0]
        f = self._file(pc["file"])
        t = f.tensor(pc["key"])
        if self.verify:
            f.check(pc["key"], _crc_of(t))
        return t

    def into(self, name, kind, dest: torch.Tensor, tp_slice, want_shape, flat=None) -> None:
        pieces = self.by_key.get((name, kind))
        if not pieces:
            raise CheckpointError(f"{self.path}: no '{kind}' stored for tensor '{name}'")
        gshape = list(pieces[0]["global_shape"])
        if gshape != list(want_shape):
            raise CheckpointError(
                f"{self.path}: tensor '{name}' has global shape {gshape} in the checkpoint but "
                f"{list(want_shape)} in this model (a checkpoint from an incompatible model?)")
        dshape, doff = _region(gshape, tp_slice)
        dnumel = math.prod(dshape)
        dlo, dhi = flat if flat is not None else (0, dnumel)
        if dest.numel() != dhi - dlo:
            raise CheckpointError(f"{self.path}: '{name}' destination has {dest.numel()} "
                                  f"elements for range [{dlo}, {dhi})")
        dflat = dest.reshape(-1) if dest.is_contiguous() else None
        if dflat is None:
            raise CheckpointError(f"{self.path}: '{name}': destination is not contiguous")
        jobs, covered = [], 0
        for pc in pieces:
            pshape, poff = _region(gshape, pc["tp_slice"])
            plo, phi = pc["flat"]
            f = self._file(pc["file"])
            dtype, _, off, nbytes = f.entry(pc["key"])
            item = torch.empty((), dtype=dtype).element_size()
            if nbytes != (phi - plo) * item or phi > math.prod(pshape):
                raise CheckpointError(f"{self.path}/{pc['file']}: piece {pc['key']} of '{name}' "
                                      f"has {nbytes // item} elements for range [{plo}, {phi})")
            if (pshape, poff, plo, phi) == (dshape, doff, dlo, dhi) and dflat.dtype == dtype \
                    and dflat.device.type == "cpu":  # saved under this layout: read in place
                covered += dflat.numel()
                jobs.append((f, pc["key"], off, dtype, [dflat.numel()], [0], [dflat.numel()],
                             dflat, True))
                continue
            for ps, pz, po in boxes_of(pshape, plo, phi):
                gps = [s + o for s, o in zip(ps, poff, strict=True)]
                for ds, dz, do in boxes_of(dshape, dlo, dhi):
                    gds = [s + o for s, o in zip(ds, doff, strict=True)]
                    lo = [max(a, b) for a, b in zip(gps, gds, strict=True)]
                    hi = [min(a + x, b + y) for a, x, b, y in zip(gps, pz, gds, dz, strict=True)]
                    if any(h <= l_ for l_, h in zip(lo, hi, strict=True)):
                        continue
                    size = [h - l_ for l_, h in zip(lo, hi, strict=True)]
                    covered += math.prod(size)
                    # Source: the stored box's bytes; destination: its box of dest.
                    src_start = [a - b for a, b in zip(lo, gps, strict=True)]
                    dst_start = [a - b for a, b in zip(lo, gds, strict=True)]
                    dview = dflat[do:do + math.prod(dz)].view(dz)
                    for d, (s, n) in enumerate(zip(dst_start, size, strict=True)):
                        dview = dview.narrow(d, s, n)
                    whole = (list(size) == list(pz) and math.prod(pz) == phi - plo
                             and dview.is_contiguous() and dview.dtype == dtype
                             and dview.device.type == "cpu")
                    jobs.append((f, pc["key"], off + po * item, dtype, list(pz), src_start,
                                 size, dview, whole))
        if covered != dest.numel():
            raise CheckpointError(
                f"{self.path}: '{kind}' of tensor '{name}' is "
                + (f"incomplete (missing {dest.numel() - covered} elements)"
                   if covered < dest.numel() else "stored twice (overlapping pieces)"))
        for job in jobs:
            self.futures.append(self.pool.submit(self._copy, *job))

    def _copy(self, f: TensorFile, key, box_off, dtype, box_shape, start, size, dview,
              whole) -> None:
        if whole:  # the stored piece is exactly this destination box
            f.read_into(dview, box_off)
            if self.verify:
                f.check(key, _crc_of(dview))
                with self._lock:
                    self.checked.add((f.path, key))
            return
        self._copy_box(f, box_off, dtype, box_shape, _strides(box_shape), start, size, dview)
        if self.verify:
            with self._lock:
                first = (f.path, key) not in self.checked
                self.checked.add((f.path, key))
            if first:
                f.check(key, f.crc_streamed(key, self.budget))

    def _copy_box(self, f, box_off, dtype, shape, strides, start, size, dview) -> None:
        item = torch.empty((), dtype=dtype).element_size()
        first = sum(s * st for s, st in zip(start, strides, strict=True))
        last = sum((s + n - 1) * st for s, n, st in zip(start, size, strides, strict=True))
        span = last - first + 1
        if span * item > self.budget:
            d = next((d for d, n in enumerate(size) if n > 1), None)
            if d is not None:  # split the box in two along its first dimension > 1
                h = size[d] // 2
                a, b = list(size), list(size)
                a[d], b[d] = h, size[d] - h
                s2 = list(start)
                s2[d] += h
                self._copy_box(f, box_off, dtype, shape, strides, start, a,
                               dview.narrow(d, 0, h))
                self._copy_box(f, box_off, dtype, shape, strides, s2, b,
                               dview.narrow(d, h, size[d] - h))
                return
        buf = torch.empty(span, dtype=dtype)
        f.read_into(buf, box_off + first * item)
        dview.copy_(buf.as_strided(size, strides))

    def wait_quietly(self) -> None:
        """Waits for queued work, ignoring its errors (after a planning error)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the planning error is the one reported
            pass

    def wait(self) -> None:
        try:
            for fut in self.futures:
                fut.result()
        finally:
            self.futures = []
            self.pool.shutdown(wait=True)
            for f in self.files.values():
                f.close()
