"""The GPT data loader against Megatron-Core's, on one large token file.

    python benchmarks/data_loader.py [--gb 1.0] [--seq-length 2048] [--read 20000]

In one run:

1. writes a ``--gb`` GB token file (uint16 ids, documents of random length)
   with our IndexedDatasetBuilder (Megatron-Core reads the same bytes);
2. ours (megatronapp.data.GPTData) and Megatron-Core's GPTDataset (built by
   its BlendedMegatronDatasetBuilder, in the peers environment, with
   ``create_attention_mask=False`` as its docs recommend for speed): time to
   first batch with the index built from scratch and read from the cache,
   then samples/s over ``--read`` samples in training order;
3. the share of the demo's step (TP2 x PP2, 4 ranks, the bundled corpus
   preprocessed) that our tracer puts in fetching the batch.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_PYTHON = os.path.join(ROOT, ".venv-peers", "bin", "python")

_MEGATRON = r"""
import json, sys, time
import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
prefix, cache, seq, samples, read, seed = sys.argv[1:7]
seq, samples, read, seed = int(seq), int(samples), int(read), int(seed)
class Tok:  # what GPTDataset needs of a tokenizer
    eod, pad, vocab_size = 0, 0, 65000
    unique_identifiers = {"class": "bench"}
def build():
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=([prefix], None),
                           split="100,0,0", tokenizer=Tok(), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False, path_to_cache=cache)
    t0 = time.perf_counter()
    ds = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, cfg).build()[0]
    ds[0]
    return ds, time.perf_counter() - t0
_, cold = build()
ds, warm = build()
t0 = time.perf_counter()
for i in range(read):
    ds[i]["tokens"]
rate = read / (time.perf_counter() - t0)
print(json.dumps({"cold": cold, "cached": warm, "samples_per_s": rate}))
"""


def make_data(prefix, gb, seed=0):
    from megatronapp.data.indexed import IndexedDatasetBuilder, exists

    if exists(prefix) and abs(os.path.getsize(prefix + ".bin") - gb * 1e9) < 0.01e9:
        return
    rng = np.random.default_rng(seed)
    left = int(gb * 1e9) // 2
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        while left > 0:
            n = int(min(left, max(1, rng.lognormal(6.5, 1.0))))
            b.add_document(rng.integers(1, 65000, n, dtype=np.uint16))
            left -= n


def ours(prefix, cache, seq, samples, read, seed):
    from megatronapp.data import build_tokenizer
    from megatronapp.data.gpt_dataset import GPTData

    tok = build_tokenizer("NullTokenizer", vocab_size=65000)

    def build():
        t0 = time.perf_counter()
        d = GPTData([prefix], "100,0,0", seq, seed, train_samples=samples, eval_samples=0,
                    tokenizer=tok, cache_dir=cache)
        d.global_batch("train", 0, 1, seed)
        return d, time.perf_counter() - t0

    _, cold = build()
    d, warm = build()
    gbs = 64
    t0 = time.perf_counter()
    for k in range(read // gbs):
        d.global_batch("train", k, gbs, seed)
    rate = (read // gbs) * gbs / (time.perf_counter() - t0)
    return {"cold": cold, "cached": warm, "samples_per_s": rate}


def demo_data_share(work):
    """Trace 12 iterations of the demo model on the preprocessed corpus."""
    from megatronapp.data import default_corpus
    from megatronapp.data.preprocess import preprocess
    from megatronapp.trace.phases import breakdown_dir

    prefix = preprocess([default_corpus()], os.path.join(work, "kjv"), append_eod=True,
                        progress=False)["outputs"]["text"]
    trace_dir = os.path.join(work, "trace")
    shutil.rmtree(trace_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", "29533",
           os.path.join(ROOT, "examples", "pretrain_gpt.py"),
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
           "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
           "--train-iters", "14", "--eval-iters", "1", "--data-path", prefix,
           "--data-cache-path", os.path.join(work, "cache"), "--trace", "--trace-dir",
           trace_dir, "--no-progress", "--output-dir", os.path.join(work, "run")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    rows = breakdown_dir(trace_dir, skip=2)
    return max(r["data"] / r["iteration"] for r in rows.values()), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--read", type=int, default=20000)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mapp-data-bench"))
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    prefix = os.path.join(a.workdir, "tokens")
    t0 = time.perf_counter()
    make_data(prefix, a.gb)
    print(f"data: {os.path.getsize(prefix + '.bin') / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)")
    from megatronapp.data.indexed import IndexedDataset

    tokens = IndexedDataset(prefix).num_tokens
    samples = (tokens - 1) // a.seq_length  # one epoch
    results = {}
    for name in ("ours", "megatron"):
        cache = os.path.join(a.workdir, f"cache-{name}")
        shutil.rmtree(cache, ignore_errors=True)
        if name == "ours":
            results[name] = ours(prefix, cache, a.seq_length, samples, a.read, 1234)
        elif os.path.exists(PEERS_PYTHON):
            p = subprocess.run([PEERS_PYTHON, "-c", _MEGATRON, prefix, cache, str(a.seq_length),
                                str(samples), str(a.read), "1234"], capture_output=True,
                               text=True, timeout=3600)
            if p.returncode != 0:
                print(p.stderr[-2000:])
                continue
            results[name] = json.loads(p.stdout.strip().splitlines()[-1])
    share, _ = demo_data_share(a.workdir)
    print(f"{tokens / 1e6:.0f}M tokens, {samples} samples of {a.seq_length} + 1 tokens (one epoch)")
    print("| loader | first batch, index built | first batch, index cached | samples/s |")
    print("|---|---|---|---|")
    for name, r in results.items():
        label = {"ours": "ours (GPTData)", "megatron": "Megatron-Core GPTDataset"}[name]
        print(f"| {label} | {r['cold']:.3f} s | {r['cached']:.4f} s | {r['samples_per_s']:.0f} |")
    if "megatron" in results:
        o, m = results["ours"], results["megatron"]
        print(f"ours vs Megatron-Core (> 1: ours better): first batch with the index built "
              f"{m['cold'] / o['cold']:.2f}x, cached {m['cached'] / o['cached']:.2f}x, "
              f"samples/s {o['samples_per_s'] / m['samples_per_s']:.2f}x")
    print(f"demo (TP2 x PP2, 4 ranks, traced): data fetch is {100 * share:.2f}% of the step "
          "(worst rank)")


if __name__ == "__main__":
    main()
