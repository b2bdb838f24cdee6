"""Train a tokenizer on local text (no downloads):

    python -m megatronapp.data.train_tokenizer --input my.txt --vocab-size 8192 --output-dir tok

prints the flags that load it (``--tokenizer-type ... --vocab-file ...``).
"""

from __future__ import annotations

import argparse
import sys

from .tokenizers import train_tokenizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatronapp.data.train_tokenizer",
                                 description="Train a tokenizer on local text (no downloads).")
    ap.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                    choices=("GPT2BPETokenizer", "SentencePieceTokenizer",
                             "GPTSentencePieceTokenizer"))
    ap.add_argument("--input", nargs="+", required=True, help="text files")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--output-dir", required=True)
    a = ap.parse_args(argv)
    try:
        flags = train_tokenizer(a.tokenizer_type, a.input, a.vocab_size, a.output_dir)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"train_tokenizer: {e}", file=sys.stderr)
        return 2
    print(" ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
