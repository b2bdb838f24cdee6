"""The real data pipeline: text / JSONL -> .bin/.idx -> the same token ids
(byte, GPT-2 BPE, SentencePiece), files interchangeable with Megatron-Core's
(when its environment exists), Megatron's sample construction reproduced
index for index, blends within 1% of their weights, splits, the same global
batch on every rank and layout, resume mid-epoch with exactly the next
samples, and corrupt or mismatched files named in the error."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import torch
from dist_harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS_PYTHON = os.path.join(ROOT, ".venv-peers", "bin", "python")


def _paragraphs(path):
    out, cur = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                cur.append(line)
            elif cur:
                out.append("".join(cur).rstrip("\n"))
                cur = []
    if cur:
        out.append("".join(cur).rstrip("\n"))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few hundred documents of the bundled corpus (one per 10 lines)."""
    from megatronapp.data import default_corpus

    d = tmp_path_factory.mktemp("corpus")
    with open(default_corpus(), encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()][:3000]
    docs = ["\n".join(lines[i:i + 10]) for i in range(0, len(lines), 10)]
    txt = d / "corpus.txt"
    txt.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    jsonl = d / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)),
                     encoding="utf-8")
    return {"dir": d, "txt": str(txt), "jsonl": str(jsonl), "docs": docs}


def test_byte_round_trip_text_to_bin_idx_with_workers(corpus):
    from megatronapp.data import build_tokenizer
    from megatronapp.data.indexed import IndexedDataset
    from megatronapp.data.preprocess import preprocess

    out = str(corpus["dir"] / "byte")
    r = preprocess([corpus["txt"]], out, append_eod=True, workers=2, progress=False)
    ds = IndexedDataset(r["outputs"]["text"])
    docs = _paragraphs(corpus["txt"])
    assert docs == corpus["docs"] and ds.num_documents == len(docs) == len(ds)
    assert ds.dtype == np.uint16  # vocabulary < 65,500
    tok = build_tokenizer("ByteTokenizer")
    for i, text in enumerate(docs):
        want = list(text.encode("utf-8")) + [tok.eod]
        assert ds[i].tolist() == want
        assert ds.document(i).tolist() == want
    assert ds.num_tokens == r["tokens"] == sum(len(t.encode()) + 1 for t in docs)
    meta = json.load(open(r["outputs"]["text"] + ".tokenizer.json"))
    assert meta["vocab_size"] == 256 and meta["eod"] == 0


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer"])
def test_trained_tokenizers_round_trip_through_jsonl(corpus, kind):
    from megatronapp.data import build_tokenizer
    from megatronapp.data.indexed import IndexedDataset
    from megatronapp.data.preprocess import preprocess
    from megatronapp.data.tokenizers import train_tokenizer

    flags = train_tokenizer(kind, [corpus["txt"]], 600, str(corpus["dir"] / kind))
    tok = build_tokenizer(**flags)
    assert 500 <= tok.vocab_size <= 700
    out = str(corpus["dir"] / f"{kind}-data")
    r = preprocess([corpus["jsonl"]], out, append_eod=True, workers=2, progress=False, **flags)
    ds = IndexedDataset(r["outputs"]["text"])
    assert len(ds) == len(corpus["docs"])
    for i, text in enumerate(corpus["docs"][:50]):
        ids = tok.tokenize(text)
        assert ds[i].tolist() == ids + [tok.eod]
        assert tok.detokenize(ids) == text  # byte-level BPE / byte-fallback: lossless
    # Far fewer tokens than bytes: a real subword vocabulary.
    assert r["tokens"] < 0.6 * sum(len(t.encode()) for t in corpus["docs"])


def test_cli_and_clear_errors(corpus, tmp_path):
    p = subprocess.run([sys.executable, "-m", "megatronapp.data.train_tokenizer", "--input",
                        corpus["txt"], "--vocab-size", "400", "--output-dir", str(tmp_path / "tok")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                str(tmp_path / "tok" / "vocab.json"), "--merge-file",
                                str(tmp_path / "tok" / "merges.txt")]
    assert "RuntimeWarning" not in p.stderr
    out = str(tmp_path / "cli")
    p = subprocess.run([sys.executable, "-m", "megatronapp.data.preprocess", "--input",
                        corpus["jsonl"], "--output-prefix", out, "--append-eod", "--workers", "2",
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"--data-path {out}_text_document" in p.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    p = subprocess.run([sys.executable, "-m", "megatronapp.data.preprocess", "--input", str(bad),
                        "--output-prefix", str(tmp_path / "x"), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and f"{bad}:2: not JSON" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "megatronapp.data.preprocess", "--input",
                        corpus["txt"], "--output-prefix", str(tmp_path / "y"), "--tokenizer-type",
                        "GPT2BPETokenizer", "--no-progress"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "needs --vocab-file" in p.stderr, p.stderr


@pytest.mark.parametrize("extra,message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "needs --vocab-file"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/nonexistent.model"],
     "/nonexistent.model: no such file"),
    (["--tokenizer-type", "NullTokenizer"], "needs --vocab-size"),
    (["--data-path", "0.5", "/nonexistent/a", "0.5", "/nonexistent/b"], "not an indexed dataset"),
    (["--data-path", "/nonexistent/a", "0.5", "/nonexistent/b"], "weight/prefix pairs"),
    (["--data-path", "0.5", "/nonexistent/a", "x", "/nonexistent/b"], "needs a weight"),
])
def test_bad_data_flags_are_rejected_before_any_collective(extra, message):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    with pytest.raises(ConfigError, match=message):
        Config.from_args(build_parser().parse_args(extra)).check(1)


def _make(prefix, docs, dtype=np.uint16):
    from megatronapp.data.indexed import IndexedDatasetBuilder

    with IndexedDatasetBuilder(prefix, dtype=dtype) as b:
        for d in docs:
            b.add_document(np.asarray(d))
    return prefix


def test_corrupt_or_mismatched_files_are_named(tmp_path):
    from megatronapp.data.indexed import CorruptDatasetError, IndexedDataset

    rng = np.random.default_rng(0)
    a = _make(str(tmp_path / "a"), [rng.integers(0, 100, n) for n in (5, 9, 4)])
    b = _make(str(tmp_path / "b"), [rng.integers(0, 100, n) for n in (7, 7)])
    IndexedDataset(a)
    shutil.copy(b + ".bin", str(tmp_path / "m.bin"))
    shutil.copy(a + ".idx", str(tmp_path / "m.idx"))
    with pytest.raises(CorruptDatasetError, match="m.bin has 28 bytes but .*m.idx describes 36"):
        IndexedDataset(str(tmp_path / "m"))
    raw = open(a + ".idx", "rb").read()
    open(str(tmp_path / "t.idx"), "wb").write(raw[:-3])
    shutil.copy(a + ".bin", str(tmp_path / "t.bin"))
    with pytest.raises(CorruptDatasetError, match="t.idx has .* truncated or corrupt"):
        IndexedDataset(str(tmp_path / "t"))
    open(str(tmp_path / "g.idx"), "wb").write(b"garbage" * 10)
    shutil.copy(a + ".bin", str(tmp_path / "g.bin"))
    with pytest.raises(CorruptDatasetError, match="g.idx is not a Megatron indexed-dataset"):
        IndexedDataset(str(tmp_path / "g"))
    with pytest.raises(FileNotFoundError, match="nope.idx does not exist"):
        IndexedDataset(str(tmp_path / "nope"))


def _gpt_indices(prefix, documents, num_samples, seq, seed, cache):
    from megatronapp.data.gpt_dataset import GPTDataset
    from megatronapp.data.indexed import IndexedDataset

    ds = GPTDataset(IndexedDataset(prefix), documents, num_samples, seq, seed, cache_dir=cache)
    return ds


def _reference_samples(ds, docs_tokens, doc_order, seq):
    """Every sample by brute force: the document order's token stream cut
    into windows of seq + 1 that overlap by one token, then shuffled."""
    stream = np.concatenate([docs_tokens[d] for d in doc_order])
    n = (len(stream) - 1) // seq
    windows = [stream[i * seq: i * seq + seq + 1] for i in range(n)]
    return [windows[int(j)] for j in ds.shuffle_index]


@pytest.mark.parametrize("num_samples", [10, 120, 300])  # 1 epoch; separate final; joined
def test_gpt_samples_cross_documents_like_a_flat_stream(tmp_path, num_samples):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 1000, n) for n in rng.integers(1, 40, 50)]
    prefix = _make(str(tmp_path / "d"), docs)
    ds = _gpt_indices(prefix, (5, 45), num_samples, 16, 7, str(tmp_path / "c"))
    assert len(ds) >= num_samples
    ref = _reference_samples(ds, docs, [int(d) for d in ds.document_index], 16)
    assert len(ref) == len(ds)
    for i in range(len(ds)):
        assert np.array_equal(ds[i], ref[i]), i
    # the split's documents only, each once per epoch
    counts = np.bincount(np.asarray(ds.document_index), minlength=50)
    assert set(counts[5:45].tolist()) == {counts[5]} and counts[:5].sum() == counts[45:].sum() == 0
    # cached: the second build maps the same files
    again = _gpt_indices(prefix, (5, 45), num_samples, 16, 7, str(tmp_path / "c"))
    assert ds.built and not again.built
    assert np.array_equal(again.shuffle_index, ds.shuffle_index)


_MEGATRON_CHECK = r"""
import json, sys
import numpy as np
from megatron.core.datasets import gpt_dataset as G, helpers
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
import megatron.core, importlib.metadata as md
ours, theirs, docs_json, out = sys.argv[1:5]
ds = IndexedDataset(ours)
docs = json.load(open(docs_json))
ok = [ds[i].tolist() == d for i, d in enumerate(docs)] + [len(ds) == len(docs)]
b = IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
for d in docs:
    b.add_document(np.asarray(d), [len(d)])
b.finalize(theirs + ".idx")
# Megatron's GPT indices for documents [5, 45), 300 samples of 16, seed 7
rs = np.random.RandomState(7)
documents = np.arange(5, 45, dtype=np.int32)
tokens = int(ds.sequence_lengths[documents].sum())
seq, num_samples = 16, 300
epochs = 1
while epochs * tokens < num_samples * seq + 1:
    epochs += 1
before = ((epochs - 1) * tokens - 1) // seq
per_epoch = (tokens - 1) // seq
separate = epochs > 1 and (num_samples - before) < int(0.8 * per_epoch)
doc_idx = G._build_document_index(documents, epochs, rs, separate)
sample_idx = helpers.build_sample_idx(ds.sequence_lengths.copy(), doc_idx, seq, epochs, tokens,
                                      True, 1)
total = sample_idx.shape[0] - 1
shuffle = G._build_shuffle_index(before if separate else total, total, rs)
np.save(out + "-document.npy", doc_idx); np.save(out + "-sample.npy", sample_idx)
np.save(out + "-shuffle.npy", shuffle)
print(json.dumps({"ok": all(ok), "version": md.version("megatron-core")}))
"""


@pytest.mark.skipif(not os.path.exists(PEERS_PYTHON),
                    reason="needs the peers environment with megatron-core (make peers)")
def test_files_and_sample_indices_agree_with_megatron_core(tmp_path):
    from megatronapp.data.indexed import IndexedDataset

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 1000, n).tolist() for n in rng.integers(1, 40, 50)]
    ours = _make(str(tmp_path / "ours"), docs)
    json.dump(docs, open(tmp_path / "docs.json", "w"))
    script = tmp_path / "check.py"
    script.write_text(_MEGATRON_CHECK)
    p = subprocess.run([PEERS_PYTHON, str(script), ours, str(tmp_path / "theirs"),
                        str(tmp_path / "docs.json"), str(tmp_path / "meg")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["ok"], "Megatron-Core reads our files differently"
    assert res["version"] == "0.16.1"
    theirs = IndexedDataset(str(tmp_path / "theirs"))  # we read theirs ...
    assert [theirs[i].tolist() for i in range(len(theirs))] == docs
    for ext in (".idx", ".bin"):  # ... and the bytes are the same
        assert open(ours + ext, "rb").read() == open(str(tmp_path / "theirs") + ext, "rb").read()
    ds = _gpt_indices(ours, (5, 45), 300, 16, 7, str(tmp_path / "c"))
    for name, arr in (("document", ds.document_index), ("sample", ds.sample_index),
                      ("shuffle", ds.shuffle_index)):
        want = np.load(str(tmp_path / f"meg-{name}.npy"))
        assert np.array_equal(np.asarray(arr), want), name


def test_blend_weights_within_one_percent_and_splits(tmp_path):
    from megatronapp.data import build_tokenizer
    from megatronapp.data.gpt_dataset import GPTData, parse_split, split_range

    rng = np.random.default_rng(2)
    # dataset A: ids < 500, B: ids >= 500 -> a sample's origin is visible
    a = _make(str(tmp_path / "a"), [rng.integers(0, 500, n) for n in rng.integers(20, 200, 400)])
    b = _make(str(tmp_path / "b"), [rng.integers(500, 1000, n) for n in rng.integers(20, 200, 300)])
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    data = GPTData(["0.7", a, "0.3", b], "90,8,2", 32, 11, train_samples=10_000, eval_samples=64,
                   tokenizer=tok, cache_dir=str(tmp_path / "c"))
    tokens, labels = data.global_batch("train", 0, 10_000, 0)
    from_a = (tokens.max(dim=1).values < 500).float().mean().item()
    assert abs(from_a - 0.7) < 0.01 * 0.7, from_a
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert split_range(parse_split("90,8,2"), 1, 400) == (360, 392)
    # valid and test documents are disjoint from train's
    va = data.splits["valid"].datasets[0]
    assert set(np.unique(va.document_index)) <= set(range(360, 392))
    for bad in ("", "-1,2", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        GPTData([a, "0.3", b], "1", 32, 1, train_samples=8, eval_samples=8, tokenizer=tok)


def _same_batch_everywhere(rank, world, tp, pp, prefix, cache):
    import megatronapp as mapp
    from megatronapp.data import build_tokenizer
    from megatronapp.data.gpt_dataset import GPTData

    st = mapp.initialize_model_parallel(tensor_model_parallel_size=tp,
                                        pipeline_model_parallel_size=pp)
    data = GPTData([prefix], "98,2,0", 32, 5, train_samples=64, eval_samples=16,
                   tokenizer=build_tokenizer("NullTokenizer", vocab_size=1000), cache_dir=cache)
    built = data.splits["train"].built
    tokens, labels = data.global_batch("train", 3, 16, 5, first_sample=48)
    mine = data.microbatches(tokens, labels, 2, st.dp_rank, st.dp_size)
    return built, tokens, [m[0] for m in mine], st.dp_rank, st.dp_size


def test_every_rank_and_layout_sees_the_same_global_batch(tmp_path):
    rng = np.random.default_rng(3)
    prefix = _make(str(tmp_path / "d"), [rng.integers(0, 1000, n)
                                         for n in rng.integers(5, 90, 200)])
    cache = str(tmp_path / "cache")
    batches = {}
    for tp, pp in ((2, 2), (1, 1), (2, 1)):
        res = run_ranks(_same_batch_everywhere, 4, tp, pp, prefix, cache)
        built = [r[0] for r in res]
        # built once (rank 0 of the first run), then read from the cache
        assert built == ([True, False, False, False] if not batches else [False] * 4)
        for r in res:
            assert torch.equal(r[1], res[0][1])
        # the data-parallel ranks' rows together are the global batch, in order
        rows = {}
        for _, _tokens, micro, dp_rank, dp_size in res:
            for m, mb in enumerate(micro):
                lo = (m * dp_size + dp_rank) * 2
                rows[lo] = mb
        assert torch.equal(torch.cat([rows[k] for k in sorted(rows)]), res[0][1])
        batches[(tp, pp)] = res[0][1]
    assert all(torch.equal(v, batches[(2, 2)]) for v in batches.values())


def _train(rank, world, extra, out_dir):
    from megatronapp.pretrain import build_parser, train

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "1", "--no-progress",
             "--log-interval", "1000"]
    s = train(build_parser().parse_args(flags + extra + ["--output-dir", out_dir]))
    return s["losses"], s["valid_loss"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--grad-compression",
     "int8", "--pipeline-schedule", "zero-bubble"],
], ids=["tp2xpp2", "tp2xdp2-zero1-int8"])
def test_training_on_a_blend_resumes_with_exactly_the_next_samples(tmp_path, corpus, layout):
    from megatronapp.data.preprocess import preprocess

    a = preprocess([corpus["txt"]], str(tmp_path / "a"), append_eod=True,
                   progress=False)["outputs"]["text"]
    b = preprocess([corpus["jsonl"]], str(tmp_path / "b"), append_eod=True,
                   progress=False)["outputs"]["text"]
    data = ["--data-path", "0.6", a, "0.4", b, "--split", "95,5,0",
            "--data-cache-path", str(tmp_path / "cache")]
    ck = str(tmp_path / "ck")
    full = run_ranks(_train, 4, layout + data + ["--train-iters", "6", "--save", ck,
                                                 "--save-interval", "3"], str(tmp_path / "o1"))
    resumed = run_ranks(_train, 4, layout + data + ["--train-iters", "6", "--load",
                                                    os.path.join(ck, "iter_0000003")],
                        str(tmp_path / "o2"))
    for (x, vx), (y, vy) in zip(full, resumed, strict=True):
        assert y == x[3:], (x, y)  # exact: the same samples in the same order
        assert vx == vy
    meta = json.load(open(os.path.join(ck, "iter_0000006", "metadata.json")))
    assert meta["extra"]["consumed_samples"] == 48
