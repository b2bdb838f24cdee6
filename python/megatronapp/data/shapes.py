"""Procedurally generated images: coloured shapes, no download.

Every sample is drawn from its own generator keyed by (seed, split, sample
index), so a global batch is identical on every rank and a resumed run sees
the samples it would have seen:

    data = ShapesData(img_size=16)
    images, labels = data.global_batch("train", it, 32, seed=1234)   # [32, 3, 16, 16], [32]
    data.describe(labels[0])                                         # "red circle"

A sample is one of four shapes (square, circle, triangle, cross) in one of
three colours, of random size and intensity, jittered around the centre, on
a noisy background; its class is ``shape * 3 + colour`` (12 classes).
"""

from __future__ import annotations

import torch

from . import TextDataset

__all__ = ["ShapesData", "SHAPES", "COLOURS"]

SHAPES = ("square", "circle", "triangle", "cross")
COLOURS = ("red", "green", "blue")
_SPLIT_SALT = {"train": 0, "valid": 1, "test": 2}


class ShapesData:
    """The data interface of the training edge (``global_batch``,
    ``microbatches``, ``has_split``) for image classification."""

    microbatches = staticmethod(TextDataset.microbatches)  # the same row layout as text

    def __init__(self, img_size: int = 16, num_channels: int = 3, noise: float = 0.1):
        if img_size < 8:
            raise ValueError(f"shapes need images of at least 8x8 pixels, got {img_size}")
        if num_channels != 3:
            raise ValueError(f"the shapes are coloured: --num-channels must be 3, got "
                             f"{num_channels}")
        self.img_size, self.noise = img_size, noise
        self.num_classes = len(SHAPES) * len(COLOURS)
        self.vocab_size = None

    def has_split(self, split: str) -> bool:
        return split in _SPLIT_SALT

    def describe(self, label: int) -> str:
        shape, colour = divmod(int(label), len(COLOURS))
        return f"{COLOURS[colour]} {SHAPES[shape]}"

    def sample(self, split: str, index: int, seed: int) -> tuple[torch.Tensor, int]:
        """One image [3, H, W] and its class."""
        if split not in _SPLIT_SALT:
            raise ValueError(f"unknown split '{split}' (expected train, valid or test)")
        g = torch.Generator().manual_seed(
            (seed * 1_000_003 + _SPLIT_SALT[split] * 7_919 + index) % (2**63 - 1))
        shape = int(torch.randint(len(SHAPES), (), generator=g))
        colour = int(torch.randint(len(COLOURS), (), generator=g))
        n = self.img_size
        r = float(torch.empty(()).uniform_(n * 0.25, n * 0.38, generator=g))
        jitter = n * 0.12  # near the centre: a small ViT learns it in minutes
        cx, cy = (float(torch.empty(()).uniform_(-jitter, jitter, generator=g)) + (n - 1) / 2
                  for _ in range(2))
        ys, xs = torch.meshgrid(torch.arange(n, dtype=torch.float32),
                                torch.arange(n, dtype=torch.float32), indexing="ij")
        dx, dy = xs - cx, ys - cy
        if shape == 0:
            mask = (dx.abs() <= r * 0.8) & (dy.abs() <= r * 0.8)
        elif shape == 1:
            mask = dx * dx + dy * dy <= r * r
        elif shape == 2:  # apex up
            mask = (dy <= r * 0.8) & (dy >= -r) & (dx.abs() <= (dy + r) * 0.55)
        else:
            arm = max(1.0, r / 3)
            mask = ((dx.abs() <= arm) & (dy.abs() <= r)) | ((dy.abs() <= arm) & (dx.abs() <= r))
        image = torch.randn(3, n, n, generator=g) * self.noise
        intensity = float(torch.empty(()).uniform_(0.7, 1.0, generator=g))
        image[colour][mask] += intensity
        return image, shape * len(COLOURS) + colour

    def global_batch(self, split: str, iteration: int, global_batch_size: int, seed: int,
                     first_sample: int | None = None):
        """(images [gbs, 3, H, W] float32, labels [gbs] int64): samples
        ``first_sample ...`` (default ``iteration * gbs``) of `split`."""
        start = iteration * global_batch_size if first_sample is None else first_sample
        pairs = [self.sample(split, start + k, seed) for k in range(global_batch_size)]
        return (torch.stack([p[0] for p in pairs]),
                torch.tensor([p[1] for p in pairs], dtype=torch.int64))
