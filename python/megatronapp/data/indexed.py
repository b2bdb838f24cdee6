"""Megatron-LM's memory-mapped indexed dataset: ``PREFIX.bin`` holds the token
ids of every sequence back to back; ``PREFIX.idx`` says where each sequence
starts and which sequences make up each document. Files written here are read
by Megatron-Core's ``IndexedDataset`` and the other way round (tested against
megatron-core 0.16.1).

``.idx`` layout (little endian)::

    b"MMIDIDX\\x00\\x00"   9-byte magic
    u64 version = 1
    u8  dtype code          1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                            6 float64, 7 float32, 8 uint16
    u64 sequence count S
    u64 document-index count D   (documents + 1)
    i32[S] sequence lengths (tokens)
    i64[S] sequence byte offsets in .bin
    i64[D] document index: 0, then the sequence count after each document
"""

from __future__ import annotations

import os
import struct

import numpy as np

__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "CorruptDatasetError", "optimal_dtype",
           "exists", "idx_path", "bin_path"]

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = len(_MAGIC) + 8 + 1 + 8 + 8
_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in _CODES.items()}


class CorruptDatasetError(ValueError):
    """A ``.idx``/``.bin`` pair that cannot be read; the message names the file."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def optimal_dtype(vocab_size: int | None):
    """uint16 for vocabularies below 65,500 ids, else int32 (Megatron's rule)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedDatasetBuilder:
    """Writes ``PREFIX.bin`` as documents arrive and ``PREFIX.idx`` at
    :meth:`finalize`::

        with IndexedDatasetBuilder(prefix, dtype=optimal_dtype(vocab)) as b:
            for doc in docs:
                b.add_document(ids)          # one sequence per document
        # or add_document(ids, lengths=[...]) for several sequences (sentences)
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"IndexedDatasetBuilder: dtype {self.dtype} is not one of "
                             f"{sorted(str(np.dtype(t)) for t in _CODES.values())}")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(bin_path(prefix), "wb")
        self._lengths: list[int] = []
        self._docs: list[int] = [0]
        self._done = False

    def add_document(self, ids, lengths=None) -> None:
        arr = np.asarray(ids)
        if arr.size and arr.dtype.kind in "iu":
            info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
            if info is not None and (arr.min() < info.min or arr.max() > info.max):
                raise ValueError(f"{self.prefix}: token ids [{arr.min()}, {arr.max()}] do not fit "
                                 f"{self.dtype}; write with a wider dtype")
        arr = arr.astype(self.dtype, copy=False).reshape(-1)
        lengths = [arr.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != arr.size:
            raise ValueError(f"add_document: sequence lengths sum to {sum(lengths)} but the "
                             f"document has {arr.size} tokens")
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.extend(lengths)
        self._docs.append(len(self._lengths))

    def add_index(self, prefix: str) -> None:
        """Appends every document of another dataset (e.g. a worker's shard)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"add_index: {prefix} holds {other.dtype}, this builder {self.dtype}")
        offset = len(self._lengths)
        with open(bin_path(prefix), "rb") as f:
            while chunk := f.read(64 << 20):
                self._bin.write(chunk)
        self._lengths.extend(int(n) for n in other.sequence_lengths)
        self._docs.extend(int(d) + offset for d in other.document_indices[1:])

    def finalize(self) -> None:
        if self._done:
            return
        self._done = True
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self._docs, dtype=np.int64)
        tmp = idx_path(self.prefix) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_MAGIC)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", _CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
        os.replace(tmp, idx_path(self.prefix))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()


class IndexedDataset:
    """Read-only, memory-mapped ``PREFIX.idx`` / ``PREFIX.bin``. ``ds[i]`` is
    sequence i (a numpy view); :meth:`get` reads a slice of one. Every size
    and offset is checked against the files when opened: a truncated,
    mismatched or foreign file is a :class:`CorruptDatasetError` naming it."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset {prefix}: {p} does not exist "
                                        "(make it with python -m megatronapp.data.preprocess)")
        size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER or head[:len(_MAGIC)] != _MAGIC:
            raise CorruptDatasetError(f"{ipath} is not a Megatron indexed-dataset index (bad magic "
                                      "or shorter than its header)")
        version, code, seqs, docs = struct.unpack("<QBQQ", head[len(_MAGIC):])
        if version != 1:
            raise CorruptDatasetError(f"{ipath}: index version {version}, expected 1")
        if code not in _CODES:
            raise CorruptDatasetError(f"{ipath}: unknown dtype code {code}")
        self.dtype = np.dtype(_CODES[code])
        want = _HEADER + seqs * (4 + 8) + docs * 8
        if size not in (want, want + seqs):  # + seqs: Megatron's multimodal sequence modes
            raise CorruptDatasetError(f"{ipath} has {size} bytes but its header describes "
                                      f"{seqs} sequences and {docs} document entries "
                                      f"({want} bytes): truncated or corrupt")
        self._idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        off = _HEADER
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, seqs, off)
        off += seqs * 4
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, seqs, off)
        off += seqs * 8
        self.document_indices = np.frombuffer(self._idx, np.int64, docs, off)
        self._check(ipath, bpath, seqs, docs)
        bsize = os.path.getsize(bpath)
        self._bin = np.memmap(bpath, mode="r", dtype=np.uint8) if bsize else np.zeros(0, np.uint8)

    def _check(self, ipath, bpath, seqs, docs):
        lengths, pointers, d = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if docs < 1 or d[0] != 0 or d[-1] != seqs or (docs > 1 and np.any(np.diff(d) < 0)):
            raise CorruptDatasetError(f"{ipath}: the document index is not an increasing run from "
                                      f"0 to the sequence count {seqs}")
        if seqs and np.any(lengths < 0):
            raise CorruptDatasetError(f"{ipath}: negative sequence lengths")
        item = self.dtype.itemsize
        end = int(pointers[-1]) + int(lengths[-1]) * item if seqs else 0
        if seqs and (pointers[0] != 0 or np.any(
                pointers[1:] != pointers[:-1] + lengths[:-1].astype(np.int64) * item)):
            raise CorruptDatasetError(f"{ipath}: sequence offsets do not follow the lengths")
        bsize = os.path.getsize(bpath)
        if bsize != end:
            raise CorruptDatasetError(
                f"{bpath} has {bsize} bytes but {ipath} describes {end} bytes of {self.dtype} "
                "tokens: the .bin and .idx do not belong together, or one is truncated")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[i])
        length = n - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) of sequence {i} "
                             f"(length {n})")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.prefix}: sequence {i} of {len(self)}")
        return self.get(i % len(self))

    def document(self, j: int) -> np.ndarray:
        """Tokens of document j (its sequences concatenated)."""
        lo, hi = int(self.document_indices[j]), int(self.document_indices[j + 1])
        return np.concatenate([self.get(i) for i in range(lo, hi)]) if hi > lo else \
            np.zeros(0, self.dtype)
