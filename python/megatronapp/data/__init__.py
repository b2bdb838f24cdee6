"""Data: the demo's download-free text stream and the real pipeline.

* :class:`TextDataset` — a token stream from one text file, split into train and
  validation ranges. Batches are drawn by a generator seeded with
  (seed, split, iteration), so every rank — whatever the parallel
  configuration — sees the same global batch at the same iteration, and each
  data-parallel rank takes its own rows. That makes runs at different
  (tp, dp) directly comparable.
* The real pipeline (docs/data.md): Megatron's ``.bin``/``.idx`` indexed
  datasets (:mod:`.indexed`), made by ``python -m megatronapp.data.preprocess``;
  GPT samples across document boundaries with cached, rank-identical indices,
  weighted blends and train/valid/test splits (:mod:`.gpt_dataset`); tokenizers
  with Megatron's names (:mod:`.tokenizers`: byte-level, GPT-2 BPE,
  SentencePiece, Hugging Face ``tokenizer.json``).
"""

from __future__ import annotations

import os

import torch

from .tokenizers import ByteTokenizer, build_tokenizer

__all__ = ["ByteTokenizer", "TextDataset", "build_tokenizer", "default_corpus",
           "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int, divisible_by: int = 128) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of
    divisible_by * tp so that every shard has the same, aligned size."""
    multiple = divisible_by * tensor_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def default_corpus() -> str:
    """Path of the public-domain corpus shipped inside the package
    (``megatronapp/assets/kjv_excerpt.txt``; see the README there)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(package, "assets", "kjv_excerpt.txt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"the bundled corpus {path} is missing (a broken installation?); "
                                "reinstall megatronapp or pass --data-path FILE")
    return path


class TextDataset:
    def __init__(self, path: str, seq_length: int, valid_fraction: float = 0.05,
                 tokenizer: ByteTokenizer | None = None):
        if not os.path.exists(path):
            raise FileNotFoundError(f"data file {path!r} does not exist")
        self.tokenizer = tokenizer or ByteTokenizer()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if isinstance(self.tokenizer, ByteTokenizer):
            tokens = self.tokenizer.encode(text)
        else:
            tokens = torch.tensor(self.tokenizer.tokenize(text), dtype=torch.long)
        n_valid = int(len(tokens) * valid_fraction)
        self.splits = {"train": tokens[: len(tokens) - n_valid], "valid": tokens[len(tokens) - n_valid:]}
        self.seq_length = seq_length
        for name, t in self.splits.items():
            if len(t) <= seq_length + 1:
                raise ValueError(
                    f"{name} split of {path!r} has {len(t)} tokens, fewer than seq_length+1 "
                    f"({seq_length + 1}); use a larger file or a shorter --seq-length")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def has_split(self, split: str) -> bool:
        return split in self.splits

    def global_batch(self, split: str, iteration: int, global_batch_size: int, seed: int,
                     first_sample: int | None = None):
        """(tokens, labels), each [global_batch_size, seq_length] int64: random
        windows keyed by (seed, split, batch number); the batch number is
        ``first_sample // global_batch_size`` when given (a resumed run's
        position), else `iteration`."""
        if first_sample is not None:
            iteration = first_sample // global_batch_size
        stream = self.splits[split]
        # A fixed mix (not hash(): Python salts string hashes per process).
        mixed = (seed * 1_000_003 + iteration * 2 + (split == "valid")) & 0x7FFFFFFFFFFF
        g = torch.Generator().manual_seed(mixed)
        starts = torch.randint(0, len(stream) - self.seq_length - 1, (global_batch_size,),
                               generator=g)
        idx = starts.unsqueeze(1) + torch.arange(self.seq_length + 1)
        window = stream[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    @staticmethod
    def microbatches(tokens, labels, micro_batch_size: int, dp_rank: int, dp_size: int):
        """This data-parallel rank's microbatches of a global batch: the rows
        [(m * dp + dp_rank) * mbs, ... + mbs) for m = 0, 1, ... `tokens` may
        be a tuple of tensors with the same rows (a VLM's images and tokens)."""
        rows = labels.shape[0]
        step = micro_batch_size * dp_size
        if rows % step != 0:
            raise ValueError(
                f"global batch size {rows} is not divisible by micro-batch size "
                f"({micro_batch_size}) x data-parallel size ({dp_size})")
        out = []
        for m in range(rows // step):
            lo = (m * dp_size + dp_rank) * micro_batch_size
            rows_m = slice(lo, lo + micro_batch_size)
            x = tuple(t[rows_m] for t in tokens) if isinstance(tokens, tuple) else tokens[rows_m]
            out.append((x, labels[rows_m]))
        return out
