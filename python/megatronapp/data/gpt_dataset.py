"""GPT pre-training samples over Megatron indexed datasets.

A :class:`GPTDataset` is one split (a range of documents) of one indexed
dataset, sampled as Megatron-Core samples it: the split's documents repeated
for as many epochs as ``num_samples`` needs and shuffled per epoch (the final
epoch separately when less than 80% of it is used), cut into samples of
``seq_length + 1`` tokens that run across document boundaries (consecutive
samples share one token: the last label), and the samples shuffled — all
with ``numpy.random.RandomState(seed)``. The three indices are built once,
saved next to the data (or in ``cache_dir``) under a hash of everything they
depend on, and read back by every rank: rank 0 builds, the others wait at a
barrier and map the files.

A :class:`BlendedDataset` mixes datasets by weight (``--data-path 0.7 web
0.3 code``): sample i comes from the dataset furthest below its share, so after
any n samples each dataset has contributed its weight x n, within one sample.

:class:`GPTData` is what the trainer holds: ``--data-path`` / ``--split`` /
the tokenizer flags in, ``global_batch(split, iteration, ...)`` out, with the
same interface as the demo's :class:`~megatronapp.data.TextDataset`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from .indexed import IndexedDataset

__all__ = ["GPTDataset", "BlendedDataset", "GPTData", "parse_split", "parse_data_path",
           "split_range", "tokenizer_metadata", "covering_vocab_size"]

SPLITS = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` -> normalized [train, valid, test] fractions."""
    try:
        parts = [float(x) for x in re.split(r"[,\s/]+", split.strip()) if x]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative weights for "
                         "train,valid,test, e.g. 949,50,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_range(fractions: list[float], which: int, num_documents: int) -> tuple[int, int]:
    """Documents [begin, end) of split `which` (Megatron's rounding)."""
    edges = [0.0]
    for f in fractions:
        edges.append(edges[-1] + f)
    begin = int(round(edges[which] * num_documents))
    end = int(round(edges[which + 1] * num_documents))
    return begin, end


def parse_data_path(items: list[str]) -> tuple[list[float], list[str]]:
    """``["P"]`` or ``["W1", "P1", "W2", "P2", ...]`` -> (normalized weights, prefixes)."""
    if len(items) == 1:
        return [1.0], list(items)
    if len(items) % 2:
        raise ValueError(f"--data-path {' '.join(items)}: give one prefix, or weight/prefix pairs "
                         "(--data-path 0.7 web 0.3 code)")
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        raise ValueError(f"--data-path {' '.join(items)}: with several datasets every prefix "
                         "needs a weight before it (--data-path 0.7 web 0.3 code)") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path: weights {weights} must be >= 0 with a positive sum")
    total = sum(weights)
    return [w / total for w in weights], list(items[1::2])


def tokenizer_metadata(prefix: str) -> dict | None:
    """What ``preprocess`` recorded about the tokenizer of PREFIX (or None)."""
    path = prefix + ".tokenizer.json"
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def covering_vocab_size(prefixes: list[str], vocab_size: int) -> int:
    """The embedding must cover every id in the data: our preprocess records
    its tokenizer next to the data (the larger vocabulary wins); files made
    elsewhere rely on the tokenizer flags."""
    for p in prefixes:
        meta = tokenizer_metadata(p)
        if meta is not None:
            vocab_size = max(vocab_size, int(meta["vocab_size"]))
    return vocab_size


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _build_document_index(docs: np.ndarray, epochs: int, rng, separate_final: bool) -> np.ndarray:
    if not separate_final or epochs == 1:
        index = np.tile(docs.astype(np.int32), epochs)
        rng.shuffle(index)
        return index
    first = _build_document_index(docs, epochs - 1, rng, False)
    last = _build_document_index(docs, 1, rng, False)
    return np.concatenate((first, last))


def _build_shuffle_index(first: int, total: int, rng) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from documents [begin, end) of
    `indexed`; ``ds[i]`` is an int64 array."""

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, *, split: str = "train",
                 cache_dir: str | None = None):
        from .. import _C

        self.indexed, self.seq_length = indexed, seq_length
        begin, end = documents
        if end <= begin:
            raise ValueError(f"{indexed.prefix}: the {split} split has no documents "
                             f"(documents [{begin}, {end}) of {indexed.num_documents}); "
                             "change --split or add data")
        if num_samples < 1:
            raise ValueError(f"{indexed.prefix}: {split} needs at least one sample")
        # Megatron's GPT datasets index sequences as documents (one per document).
        docs = np.arange(begin, end, dtype=np.int32)
        self.description = {
            "class": "GPTDataset", "prefix": os.path.abspath(indexed.prefix),
            # what the data is, not when it was copied: node-local copies of the
            # same files give the same key on every node
            "sequences": len(indexed), "tokens": indexed.num_tokens,
            "idx_bytes": os.path.getsize(indexed.prefix + ".idx"),
            "split": split, "documents": [begin, end], "num_samples": num_samples,
            "seq_length": seq_length, "seed": seed, "extra_token": 1,
        }
        text = json.dumps(self.description, sort_keys=True)
        key = hashlib.md5(text.encode()).hexdigest()
        cache = cache_dir or os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)),
                                          "cache", "GPTDataset_indices")
        base = os.path.join(cache, f"{key}-GPTDataset-{split}")
        paths = {k: f"{base}-{k}_index.npy" for k in ("document", "sample", "shuffle")}
        desc_path = f"{base}-description.json"
        dist = _dist()
        self.built = False
        if not all(os.path.isfile(p) for p in [*paths.values(), desc_path]):
            if dist is None or dist.get_rank() == 0:
                self._build(docs, num_samples, seed, paths, desc_path, text, cache, _C)
                self.built = True
        if dist is not None:
            dist.barrier()
        if not os.path.isfile(desc_path):
            raise FileNotFoundError(
                f"{indexed.prefix}: the {split} sample indices rank 0 built are not in {cache} "
                "on this rank; every rank must see the same cache directory (set "
                "--data-cache-path to a filesystem all nodes share, or copy the cache)")
        with open(desc_path) as f:
            if f.read() != text:
                raise ValueError(f"{desc_path} describes other indices than {text} "
                                 "(a hash collision or an edited cache); delete it")
        self.document_index = np.load(paths["document"], mmap_mode="r")
        self.sample_index = np.load(paths["sample"], mmap_mode="r")
        self.shuffle_index = np.load(paths["shuffle"], mmap_mode="r")
        self.cache_files = paths

    def _build(self, docs, num_samples, seed, paths, desc_path, text, cache, _C):
        sizes = self.indexed.sequence_lengths
        tokens_per_epoch = int(sizes[docs].sum(dtype=np.int64))
        seq = self.seq_length
        if tokens_per_epoch < 2:
            raise ValueError(f"{self.indexed.prefix}: the split has {tokens_per_epoch} tokens")
        epochs, tokens = 1, tokens_per_epoch
        while tokens < num_samples * seq + 1:
            epochs += 1
            tokens += tokens_per_epoch
        separate = False
        if epochs > 1:
            before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq
            from_final = num_samples - before_final
            per_epoch = (tokens_per_epoch - 1) // seq
            separate = from_final < int(0.80 * per_epoch)
        rng = np.random.RandomState(seed)
        document_index = _build_document_index(docs, epochs, rng, separate)
        sample_index = _C.build_sample_index(sizes, document_index, seq, epochs * tokens_per_epoch,
                                             True, 1)
        total = sample_index.shape[0] - 1
        shuffle_index = _build_shuffle_index(before_final if separate else total, total, rng)
        os.makedirs(cache, exist_ok=True)
        for name, arr in (("document", document_index), ("sample", sample_index),
                          ("shuffle", shuffle_index)):
            tmp = paths[name] + f".tmp{os.getpid()}.npy"
            np.save(tmp, arr)
            os.replace(tmp, paths[name])
        tmp = desc_path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, desc_path)  # last: its presence means the indices are complete

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        doc = self.document_index
        if d0 == d1:
            out = self.indexed.get(int(doc[d0]), o0, o1 - o0 + 1)
        else:
            parts = [self.indexed.get(int(doc[d0]), o0)]
            parts += [self.indexed.get(int(doc[k])) for k in range(d0 + 1, d1)]
            parts.append(self.indexed.get(int(doc[d1]), 0, o1 + 1))
            out = np.concatenate(parts)
        return out.astype(np.int64)


class BlendedDataset:
    """Samples drawn from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        from .. import _C

        if len(datasets) != len(weights):
            raise ValueError("BlendedDataset: one weight per dataset")
        self.datasets, self.weights, self.size = datasets, list(weights), size
        w = np.asarray(weights, dtype=np.float64)
        self.dataset_index, self.dataset_sample_index = _C.build_blend_index(w / w.sum(), size)
        for j, ds in enumerate(datasets):
            need = int(np.count_nonzero(self.dataset_index == j))
            if need > len(ds):
                raise ValueError(f"BlendedDataset: dataset {j} has {len(ds)} samples but the blend "
                                 f"draws {need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


class GPTData:
    """The trainer's data: train/valid/test GPT datasets (blended when
    ``data_path`` names several) and the tokenizer. Global batch k of the
    training run is samples [first + k*B, first + (k+1)*B) where `first` is
    the consumed-samples count a resumed run starts from; validation batch k
    is samples [k*B, (k+1)*B) of the valid split (the same each evaluation)."""

    def __init__(self, data_path: list[str], split: str, seq_length: int, seed: int, *,
                 train_samples: int, eval_samples: int, tokenizer, cache_dir: str | None = None,
                 test_samples: int = 0):
        from .indexed import exists

        self.tokenizer, self.seq_length = tokenizer, seq_length
        weights, prefixes = parse_data_path(data_path)
        for p in prefixes:
            if not exists(p):
                raise FileNotFoundError(
                    f"--data-path {p}: {p}.idx / {p}.bin not found (make them with "
                    "python -m megatronapp.data.preprocess --input FILE --output-prefix ...)")
        indexed = [IndexedDataset(p) for p in prefixes]
        self.vocab_size = covering_vocab_size(prefixes, tokenizer.vocab_size)
        fractions = parse_split(split)
        sizes = {"train": train_samples, "valid": eval_samples, "test": test_samples}
        self.splits = {}
        for which, name in enumerate(SPLITS):
            if fractions[which] == 0 or sizes[name] == 0:
                continue
            want = sizes[name]
            ranges = [split_range(fractions, which, len(ds)) for ds in indexed]
            if name != "train" and any(hi <= lo for lo, hi in ranges):
                # --split rounds to no documents of some dataset: no such split
                # (the trainer then skips evaluation), as with a weight of 0.
                import warnings

                warnings.warn(f"--split {split}: the {name} split of "
                              f"{prefixes[[hi <= lo for lo, hi in ranges].index(True)]} has no "
                              f"documents; no {name} data", stacklevel=2)
                continue
            parts = []
            for w, ds, rng in zip(weights, indexed, ranges, strict=True):
                # each part a little larger than its share (Megatron: 0.5% surplus)
                n = int(np.ceil(want * w * 1.005)) + 1
                parts.append(GPTDataset(ds, rng, n, seq_length, seed, split=name,
                                        cache_dir=cache_dir))
            self.splits[name] = (parts[0] if len(parts) == 1 else
                                 BlendedDataset(parts, weights, want))
        if "train" not in self.splits:
            raise ValueError(f"--split {split}: the train split is empty")

    def has_split(self, split: str) -> bool:
        return split in self.splits

    def global_batch(self, split: str, iteration: int, global_batch_size: int, seed: int,
                     first_sample: int | None = None):
        """(tokens, labels), each [global_batch_size, seq_length] int64."""
        import torch

        ds = self.splits[split]
        start = iteration * global_batch_size if first_sample is None else first_sample
        if start + global_batch_size > len(ds):
            raise IndexError(f"{split} samples [{start}, {start + global_batch_size}) but the "
                             f"dataset was built for {len(ds)}")
        rows = np.stack([ds[i] for i in range(start, start + global_batch_size)])
        window = torch.from_numpy(rows)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    @staticmethod
    def microbatches(tokens, labels, micro_batch_size: int, dp_rank: int, dp_size: int):
        from . import TextDataset

        return TextDataset.microbatches(tokens, labels, micro_batch_size, dp_rank, dp_size)
