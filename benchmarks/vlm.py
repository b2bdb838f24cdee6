"""Does the VLM use the image? Its caption loss side by side with a
text-only model's on the same captions, in one run.

Both rows train through ``megatronapp.training.train`` (the
examples/pretrain_vlm.py path) with the same flags, data order, decoder,
optimizer and schedule on real Gloo ranks:

- ``vlm``: ViT encoder -> MLP projector -> GPT decoder, the image's
  embeddings in place of the image token;
- ``text-only``: the same decoder on the same caption rows, the image token
  replaced by ``<bos>`` and no image (``--text-only``).

The captions ("a red square left of a blue circle") draw two colours, two
shapes and a relation; a text-only model can learn only their frequencies,
so its loss has a floor at the captions' entropy per text token (computed
exactly here: (2 ln 3 + 2 ln 4 + ln 4) / 9 nats for the 9 targets of a
"left of"/"right of" caption, the 8 of an "above"/"below" one weighted in).
Reported per row: validation caption loss and token accuracy (top-1 over
the vocabulary, text targets only), the share of greedy captions of 128
unseen images that are right (either shape first), final training loss,
wall time; and the VLM / text-only loss ratio.

    .venv/bin/python benchmarks/vlm.py                 # ~15 min on 2 cores
    .venv/bin/python benchmarks/vlm.py --iters 200     # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from dist_harness import run_ranks  # noqa: E402


def _job(rank, world, flags, out):
    from megatronapp.pretrain_vlm import build_parser
    from megatronapp.training import train
    from megatronapp.training.vision import AccuracyHook, CaptionHook, VLMTask

    args = build_parser().parse_args(flags + ["--output-dir", out])
    text_only = args.text_only
    del args.text_only
    t0 = time.perf_counter()
    s = train(args, task=VLMTask(text_only=text_only),
              hooks=[AccuracyHook(), CaptionHook(n=128, show=4)])
    return {"valid_loss": s["valid_loss"], "valid_accuracy": s["valid_accuracy"],
            "caption_accuracy": s["caption_accuracy"], "captions": s["captions"][:8],
            "final_loss": s["final_loss"], "parameters": s["parameters"],
            "wall_s": time.perf_counter() - t0}


def entropy_floor() -> float:
    """Nats per text target of the captions for a model that cannot see the
    image: colours (3) and shapes (4) uniform and independent, the relation
    one of four; "of" and "a" and <eos> are determined."""
    h_objects = 2 * math.log(3) + 2 * math.log(4)
    # half the captions are horizontal (9 targets: a C S left of a C S <eos>),
    # half vertical (8 targets); the relation word carries ln 4 in both
    # (which of left/right/above/below), "of" nothing
    per_caption = h_objects + math.log(4)
    return per_caption / 8.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "vlm.json"))
    a = ap.parse_args()
    flags = ["--tensor-model-parallel-size", str(a.tp), "--num-layers", "4",
             "--encoder-num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
             "--img-h", "32", "--img-w", "32", "--patch-dim", "4", "--seq-length", "74",
             "--micro-batch-size", "8", "--global-batch-size", "32", "--lr", "1e-3",
             "--min-lr", "1e-4", "--lr-warmup-iters", "20", "--train-iters", str(a.iters),
             "--eval-iters", "16", "--eval-interval", str(a.iters), "--no-progress",
             "--log-interval", "100000"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("vlm", []), ("text-only", ["--text-only"])):
            rows[name] = run_ranks(_job, a.ranks, flags + extra, os.path.join(tmp, name),
                                   timeout=7200)[0]
            print(name, rows[name], flush=True)
    result = {"command": "benchmarks/vlm.py " + " ".join(sys.argv[1:]), "ranks": a.ranks,
              "flags": flags, "rows": rows, "entropy_floor": entropy_floor(),
              "loss_ratio": rows["vlm"]["valid_loss"] / rows["text-only"]["valid_loss"]}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n| model | parameters | validation caption loss | token accuracy | greedy captions "
          "right | final train loss | wall |\n|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['parameters'] / 1e6:.2f}M | {r['valid_loss']:.3f} | "
              f"{r['valid_accuracy']:.1%} | {r['caption_accuracy']:.1%} | "
              f"{r['final_loss']:.3f} | {r['wall_s']:.0f} s |")
    print(f"\ntext-only floor (caption entropy): {entropy_floor():.3f} nats/token; "
          f"VLM / text-only validation loss: {result['loss_ratio']:.3f}")


if __name__ == "__main__":
    main()
