"""Text or JSONL -> Megatron ``.bin``/``.idx`` indexed datasets.

    python -m megatronapp.data.preprocess --input corpus.jsonl \\
        --output-prefix data/corpus --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8

writes ``data/corpus_text_document.{bin,idx}`` (Megatron's naming: one pair per
``--json-keys`` key), which ``--data-path data/corpus_text_document`` trains on.

Inputs: ``.jsonl``/``.json`` files hold one JSON object per line (the text
under each of ``--json-keys``); any other file is plain text, split into
documents at blank lines (``--text-document paragraph``, the default), at
every line, or one document per file. Documents are tokenized by ``--workers``
processes, written in input order; empty documents are skipped.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time

from .indexed import IndexedDatasetBuilder, optimal_dtype
from .tokenizers import TOKENIZER_TYPES, build_tokenizer

__all__ = ["preprocess", "main"]

_TOKENIZER = None
_KEYS: list[str] = []
_EOD = False


def _init(tokenizer_kwargs, keys, append_eod):
    global _TOKENIZER, _KEYS, _EOD
    _TOKENIZER = build_tokenizer(**tokenizer_kwargs)
    _KEYS, _EOD = keys, append_eod


def _encode(doc):
    """doc: a JSON line (str) or a plain-text document ({"text": ...}) ->
    per key the ids (with eod), and the input's bytes."""
    if isinstance(doc, str):
        try:
            obj = json.loads(doc)
        except json.JSONDecodeError as e:
            return None, f"not JSON ({e})"
    else:
        obj = doc
    out = []
    for key in _KEYS:
        if key not in obj:
            return None, f"no key '{key}' (use --json-keys)"
        ids = _TOKENIZER.tokenize(obj[key])
        if ids and _EOD:
            ids.append(_TOKENIZER.eod)
        out.append(ids)
    return out, None


def _documents(path: str, mode: str):
    """Yields (source location, document) of one input file."""
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{n}", line
        return
    with open(path, encoding="utf-8") as f:
        if mode == "file":
            yield path, {"text": f.read()}
            return
        if mode == "line":
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{n}", {"text": line.rstrip("\n")}
            return
        para, start = [], 1
        for n, line in enumerate(f, 1):
            if line.strip():
                if not para:
                    start = n
                para.append(line)
            elif para:
                yield f"{path}:{start}", {"text": "".join(para).rstrip("\n")}
                para = []
        if para:
            yield f"{path}:{start}", {"text": "".join(para).rstrip("\n")}


def preprocess(inputs: list[str], output_prefix: str, *, tokenizer_type: str = "ByteTokenizer",
               vocab_file: str | None = None, merge_file: str | None = None,
               tokenizer_model: str | None = None, vocab_size: int | None = None,
               json_keys=("text",), append_eod: bool = True, workers: int = 1,
               text_document: str = "paragraph", progress: bool = True) -> dict:
    """Tokenizes `inputs` into ``{output_prefix}_{key}_document.{bin,idx}``;
    returns {"outputs": {key: prefix}, "documents", "tokens", "seconds"}."""
    for p in inputs:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"--input {p}: no such file")
    tok_kwargs = dict(tokenizer_type=tokenizer_type, vocab_file=vocab_file,
                      merge_file=merge_file, tokenizer_model=tokenizer_model,
                      vocab_size=vocab_size)
    tokenizer = build_tokenizer(**tok_kwargs)  # fails here, not in a worker, on bad flags
    keys = list(json_keys)
    dtype = optimal_dtype(tokenizer.vocab_size)
    outputs = {k: f"{output_prefix}_{k}_document" for k in keys}
    builders = {k: IndexedDatasetBuilder(p, dtype=dtype) for k, p in outputs.items()}
    total_bytes = sum(os.path.getsize(p) for p in inputs)

    def docs():
        for p in inputs:
            yield from _documents(p, text_document)

    locs: collections.deque = collections.deque()  # of documents handed out, in order

    def numbered():
        for loc, d in docs():
            locs.append(loc)
            yield d

    t0 = time.perf_counter()
    n_docs = n_tokens = 0
    bar = pool = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, mininterval=0.5)
    try:
        if workers > 1:
            pool = mp.get_context("spawn").Pool(workers, _init, (tok_kwargs, keys, append_eod))
            results = pool.imap(_encode, numbered(), chunksize=64)
        else:
            _init(tok_kwargs, keys, append_eod)
            results = map(_encode, numbered())
        for ids, err in results:
            loc = locs.popleft()
            if err is not None:
                raise ValueError(f"{loc}: {err}")
            if all(len(x) == 0 for x in ids):
                continue
            for k, x in zip(keys, ids, strict=True):
                builders[k].add_document(x)
            n_docs += 1
            n_tokens += len(ids[0])
            if bar is not None:
                bar.update(1)
        if pool is not None:
            pool.close()
            pool.join()
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        if bar is not None:
            bar.close()
    meta = {k: v for k, v in tok_kwargs.items() if v is not None}
    meta.update(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod, append_eod=append_eod)
    for key, b in builders.items():
        b.finalize()
        with open(outputs[key] + ".tokenizer.json", "w") as f:
            json.dump(meta, f, indent=1)
    seconds = time.perf_counter() - t0
    return {"outputs": outputs, "documents": n_docs, "tokens": n_tokens, "seconds": seconds,
            "input_bytes": total_bytes, "vocab_size": tokenizer.vocab_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatronapp.data.preprocess",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--json-keys", nargs="+", default=["text"])
    ap.add_argument("--text-document", choices=("paragraph", "line", "file"), default="paragraph",
                    help="plain-text inputs: what one document is")
    ap.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES)
    ap.add_argument("--vocab-file")
    ap.add_argument("--merge-file")
    ap.add_argument("--tokenizer-model")
    ap.add_argument("--vocab-size", type=int, help="NullTokenizer: number of ids")
    ap.add_argument("--append-eod", action="store_true",
                    help="end every document with the tokenizer's end-of-document id")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.workers < 1:
        ap.error("--workers must be >= 1")
    try:
        r = preprocess(a.input, a.output_prefix, tokenizer_type=a.tokenizer_type,
                       vocab_file=a.vocab_file, merge_file=a.merge_file,
                       tokenizer_model=a.tokenizer_model, vocab_size=a.vocab_size,
                       json_keys=a.json_keys, append_eod=a.append_eod, workers=a.workers,
                       text_document=a.text_document, progress=not a.no_progress)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"preprocess: {e}", file=sys.stderr)
        return 2
    rate = r["input_bytes"] / max(r["seconds"], 1e-9) / 1e6
    print(f"{r['documents']} documents, {r['tokens']} tokens in {r['seconds']:.1f} s "
          f"({rate:.1f} MB/s, vocabulary {r['vocab_size']})")
    for key, prefix in r["outputs"].items():
        print(f"{key}: --data-path {prefix}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
