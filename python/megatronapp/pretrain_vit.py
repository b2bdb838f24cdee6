"""Megatron-style ViT pretraining on generated images (examples/pretrain_vit.py).

Launch with torchrun; every flag has a small CPU-friendly default:

    torchrun --nproc-per-node 4 examples/pretrain_vit.py \\
        --tensor-model-parallel-size 2 --train-iters 200

The same flags and outputs as pretrain_gpt.py (progress bar, loss CSV/PNG,
summary.json, --save/--load) plus Megatron's vision flags (--img-h, --img-w,
--patch-dim, --num-channels, --num-classes). The data is the generated
coloured-shapes set (12 classes, :mod:`megatronapp.data.shapes`); rank 0
reports the validation accuracy. The work is done by
:mod:`megatronapp.training` with :class:`~megatronapp.training.vision.ViTTask`.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from .training import build_parser as _build_parser
from .training import train
from .training.vision import AccuracyHook, ViTTask

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = _build_parser(__doc__.splitlines()[0])
    parser.set_defaults(output_dir="runs/vit")
    return parser


def main(argv=None) -> dict:
    summary = train(build_parser().parse_args(argv), task=ViTTask(), hooks=[AccuracyHook()])
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
