"""Megatron-style GPT pretraining on the bundled corpus (examples/pretrain_gpt.py).

Launch with torchrun; every flag has a small CPU-friendly default:

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --train-iters 200

Each iteration draws one global batch (identical on every rank for a given
seed), runs this rank's part of the pipeline schedule over its data-parallel
share of microbatches, finishes the gradients (data-parallel reduction,
sequence-parallel and tied-embedding sums, norm, clipping) and steps. Rank 0
shows a progress bar (loss, tokens/s), prints a summary, and writes the loss
curve as CSV and PNG into --output-dir. The work is done by
:mod:`megatronapp.training`; this module is its command line.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from .training import build_parser as _build_parser
from .training import train

__all__ = ["build_parser", "train", "main"]


def build_parser() -> argparse.ArgumentParser:
    return _build_parser(__doc__.splitlines()[0])


def main(argv=None) -> None:
    train(build_parser().parse_args(argv))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
