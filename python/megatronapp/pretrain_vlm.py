"""Megatron-style LLaVA-like VLM pretraining on generated captions (examples/pretrain_vlm.py).

Launch with torchrun; every flag has a small CPU-friendly default:

    torchrun --nproc-per-node 4 examples/pretrain_vlm.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --train-iters 200

The same flags and outputs as pretrain_gpt.py (progress bar, loss CSV/PNG,
summary.json, --save/--load) plus Megatron's vision flags (--img-h, --img-w,
--patch-dim, --num-channels, --encoder-num-layers,
--disable-vision-class-token). --seq-length is the decoder's combined
sequence: the image tokens ((img/patch)^2, +1 for the class token) and the
caption text. The data are generated images of two shapes with their
captions ("a red square left of a blue circle",
:class:`megatronapp.data.shapes.CaptionData`); the loss is over the caption
tokens only; rank 0 reports the validation token accuracy (top-1 over the
vocabulary, text targets only) and, with one pipeline stage, greedy captions
of a few validation images against the true ones. The work is done by :mod:`megatronapp.training` with
:class:`~megatronapp.training.vision.VLMTask`.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from .training import build_parser as _build_parser
from .training import train
from .training.vision import AccuracyHook, CaptionHook, VLMTask

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = _build_parser(__doc__.splitlines()[0])
    parser.add_argument("--text-only", action="store_true",
                        help="the baseline: the same decoder on the caption text, no image")
    # 32x32 images in 4x4 patches: 64 patches + the class token, then 10 text tokens
    parser.set_defaults(output_dir="runs/vlm", img_h=32, img_w=32, seq_length=74)
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    text_only = args.text_only
    del args.text_only
    summary = train(args, task=VLMTask(text_only=text_only), hooks=[AccuracyHook(), CaptionHook()])
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
