"""Tokenizers, with Megatron-LM's ``--tokenizer-type`` names; nothing is
downloaded, ever. Each has ``vocab_size``, ``eod`` (the end-of-document id
that separates documents in a token stream), ``tokenize(text) -> list[int]``
and ``detokenize(ids) -> str``.

=========================  ==================================================
``ByteTokenizer``          UTF-8 bytes (vocabulary 256, ``eod`` = 0, the NUL
                           byte); the default, needs no file
``GPT2BPETokenizer``       byte-level BPE from GPT-2's ``--vocab-file``
                           (vocab.json) and ``--merge-file`` (merges.txt),
                           through the ``tokenizers`` package
``HuggingFaceTokenizer``   a ``tokenizer.json`` file (``--tokenizer-model``)
``SentencePieceTokenizer``  a SentencePiece ``--tokenizer-model`` (``.model``);
``GPTSentencePieceTokenizer``  ``eod`` is its end-of-sentence id
``NullTokenizer``          text is whitespace-separated ids; ``--vocab-size``
                           ids, ``eod`` = the last
=========================  ==================================================

:func:`train_tokenizer` trains a GPT-2-style BPE or a SentencePiece model on
local files (``python -m megatronapp.data.train_tokenizer ...``).
"""

from __future__ import annotations

import os

__all__ = ["ByteTokenizer", "TOKENIZER_TYPES", "build_tokenizer", "train_tokenizer"]

TOKENIZER_TYPES = ("ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "NullTokenizer")
EOD_TEXT = "<|endoftext|>"  # GPT-2's document separator


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256). Nothing to download or train,
    and every text round-trips; the NUL byte (absent from text) separates
    documents."""

    vocab_size = 256
    eod = 0

    def encode(self, text: str):
        import torch

        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return self.decode(ids)


def _need(package: str, what: str):
    try:
        return __import__(package)
    except ImportError:
        raise ImportError(f"{what} needs the '{package}' package: pip install {package}") from None


def _file(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type {kind} needs {flag}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    return path


class _HFTokenizer:
    """A ``tokenizers.Tokenizer`` (GPT-2 BPE files or a tokenizer.json)."""

    def __init__(self, tok, eod_text: str | None, kind: str):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eod = tok.token_to_id(eod_text) if eod_text else None
        if eod is None:
            for cand in (EOD_TEXT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]"):
                eod = tok.token_to_id(cand)
                if eod is not None:
                    break
        if eod is None:
            raise ValueError(f"{kind}: the vocabulary has no end-of-document token "
                             f"({EOD_TEXT} or </s>); add one when training it")
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class _SentencePiece:
    def __init__(self, model: str, kind: str):
        spm = _need("sentencepiece", kind)
        self._sp = spm.SentencePieceProcessor(model_file=model)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"{kind} {model}: the model has no end-of-sentence piece (eos_id < 0)")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class _NullTokenizer:
    def __init__(self, vocab_size: int | None):
        if not vocab_size or vocab_size < 2:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size >= 2")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} are outside [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str = "ByteTokenizer", *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    vocab_size: int | None = None):
    """The tokenizer of Megatron's flags (``--tokenizer-type``, ``--vocab-file``,
    ``--merge-file``, ``--tokenizer-model``, ``--vocab-size``)."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        tk = _need("tokenizers", tokenizer_type)
        vocab = _file(vocab_file, "--vocab-file", tokenizer_type)
        merges = _file(merge_file, "--merge-file", tokenizer_type)
        model = tk.models.BPE.from_file(vocab, merges)
        tok = tk.Tokenizer(model)
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        return _HFTokenizer(tok, EOD_TEXT, tokenizer_type)
    if tokenizer_type == "HuggingFaceTokenizer":
        tk = _need("tokenizers", tokenizer_type)
        path = _file(tokenizer_model, "--tokenizer-model", tokenizer_type)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        return _HFTokenizer(tk.Tokenizer.from_file(path), None, tokenizer_type)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return _SentencePiece(_file(tokenizer_model, "--tokenizer-model", tokenizer_type),
                              tokenizer_type)
    if tokenizer_type == "NullTokenizer":
        return _NullTokenizer(vocab_size)
    raise ValueError(f"unknown --tokenizer-type '{tokenizer_type}' "
                     f"(expected one of {', '.join(TOKENIZER_TYPES)})")


def train_tokenizer(tokenizer_type: str, files: list[str], vocab_size: int, output_dir: str) -> dict:
    """Trains a tokenizer on local text files; returns the flags that load it
    (``{"tokenizer_type": ..., "vocab_file": ..., ...}``)."""
    os.makedirs(output_dir, exist_ok=True)
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"tokenizer training input {f}: no such file")
    if tokenizer_type == "GPT2BPETokenizer":
        tk = _need("tokenizers", tokenizer_type)
        bpe = tk.ByteLevelBPETokenizer(add_prefix_space=False)
        bpe.train(files, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TEXT],
                  show_progress=False)
        vocab, merges = bpe.save_model(output_dir)
        return {"tokenizer_type": tokenizer_type, "vocab_file": vocab, "merge_file": merges}
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        spm = _need("sentencepiece", tokenizer_type)
        prefix = os.path.join(output_dir, "spm")
        spm.SentencePieceTrainer.train(input=",".join(files), model_prefix=prefix,
                                       vocab_size=vocab_size, model_type="bpe",
                                       character_coverage=1.0, byte_fallback=True,
                                       # lossless: no NFKC, spaces and newlines kept
                                       normalization_rule_name="identity",
                                       remove_extra_whitespaces=False,
                                       user_defined_symbols=["\n"], minloglevel=2)
        return {"tokenizer_type": tokenizer_type, "tokenizer_model": prefix + ".model"}
    raise ValueError(f"train_tokenizer: cannot train a {tokenizer_type}; "
                     "use GPT2BPETokenizer or SentencePieceTokenizer")
