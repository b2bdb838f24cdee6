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

__all__ = ["ShapesData", "CaptionData", "CAPTION_VOCAB", "SHAPES", "COLOURS", "shape_mask"]

SHAPES = ("square", "circle", "triangle", "cross")
COLOURS = ("red", "green", "blue")
_SPLIT_SALT = {"train": 0, "valid": 1, "test": 2}


def shape_mask(n: int, shape: int, cx: float, cy: float, r: float) -> torch.Tensor:
    """[n, n] bool: the pixels of `shape` (an index into SHAPES) of radius
    `r` centred at (cx, cy)."""
    ys, xs = torch.meshgrid(torch.arange(n, dtype=torch.float32),
                            torch.arange(n, dtype=torch.float32), indexing="ij")
    dx, dy = xs - cx, ys - cy
    if shape == 0:
        return (dx.abs() <= r * 0.8) & (dy.abs() <= r * 0.8)
    if shape == 1:
        return dx * dx + dy * dy <= r * r
    if shape == 2:  # apex up
        return (dy <= r * 0.8) & (dy >= -r) & (dx.abs() <= (dy + r) * 0.55)
    arm = max(1.0, r / 3)
    return ((dx.abs() <= arm) & (dy.abs() <= r)) | ((dy.abs() <= arm) & (dx.abs() <= r))


def _generator(seed: int, split: str, index: int) -> torch.Generator:
    if split not in _SPLIT_SALT:
        raise ValueError(f"unknown split '{split}' (expected train, valid or test)")
    return torch.Generator().manual_seed(
        (seed * 1_000_003 + _SPLIT_SALT[split] * 7_919 + index) % (2**63 - 1))


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
        g = _generator(seed, split, index)
        shape = int(torch.randint(len(SHAPES), (), generator=g))
        colour = int(torch.randint(len(COLOURS), (), generator=g))
        n = self.img_size
        r = float(torch.empty(()).uniform_(n * 0.25, n * 0.38, generator=g))
        jitter = n * 0.12  # near the centre: a small ViT learns it in minutes
        cx, cy = (float(torch.empty(()).uniform_(-jitter, jitter, generator=g)) + (n - 1) / 2
                  for _ in range(2))
        image = torch.randn(3, n, n, generator=g) * self.noise
        intensity = float(torch.empty(()).uniform_(0.7, 1.0, generator=g))
        image[colour][shape_mask(n, shape, cx, cy, r)] += intensity
        return image, shape * len(COLOURS) + colour

    def global_batch(self, split: str, iteration: int, global_batch_size: int, seed: int,
                     first_sample: int | None = None):
        """(images [gbs, 3, H, W] float32, labels [gbs] int64): samples
        ``first_sample ...`` (default ``iteration * gbs``) of `split`."""
        start = iteration * global_batch_size if first_sample is None else first_sample
        pairs = [self.sample(split, start + k, seed) for k in range(global_batch_size)]
        return (torch.stack([p[0] for p in pairs]),
                torch.tensor([p[1] for p in pairs], dtype=torch.int64))


#: the caption vocabulary; ids are positions (the image token is 3)
CAPTION_VOCAB = ("<pad>", "<bos>", "<eos>", "<image>", "a", *COLOURS, *SHAPES,
                 "left", "right", "of", "above", "below")
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID = 0, 1, 2, 3
_WORD_ID = {w: i for i, w in enumerate(CAPTION_VOCAB)}
MAX_CAPTION_TOKENS = 9  #: "a red square left of a blue circle" + <eos>


class CaptionData:
    """Two shapes side by side or one above the other, captioned
    ("a red square left of a blue circle"), for the VLM.

    A text row is ``<image> a red square left of a blue circle <eos> <pad> ...``
    (`text_length` tokens); its labels are in the decoder's combined
    sequence (the image token replaced by `num_image_tokens` embeddings),
    text targets only (:func:`megatronapp.models.vlm.combined_labels`).
    With ``text_only`` the image token is ``<bos>`` and no image is given:
    the same targets for a text-only model, the baseline the VLM must beat.
    ``global_batch`` returns ``((images, tokens), labels)`` (``(tokens,
    labels)`` text-only), identical on every rank."""

    microbatches = staticmethod(TextDataset.microbatches)  # (images, tokens) rows split alike

    def __init__(self, img_size: int = 32, num_image_tokens: int = 64, text_length: int = 10,
                 text_only: bool = False, noise: float = 0.1):
        if img_size < 16:
            raise ValueError(f"two shapes need images of at least 16x16 pixels, got {img_size}")
        if text_length < MAX_CAPTION_TOKENS + 1:
            raise ValueError(f"captions need {MAX_CAPTION_TOKENS + 1} text tokens (the image "
                             f"token, up to 8 words and <eos>), got {text_length}: raise "
                             "--seq-length")
        self.img_size, self.noise, self.text_only = img_size, noise, text_only
        self.num_image_tokens, self.text_length = num_image_tokens, text_length
        self.vocab_size = len(CAPTION_VOCAB)

    def has_split(self, split: str) -> bool:
        return split in _SPLIT_SALT

    @staticmethod
    def describe(tokens) -> str:
        """The caption of a text row."""
        words = [CAPTION_VOCAB[int(t)] for t in tokens]
        return " ".join(w for w in words if not w.startswith("<"))

    @staticmethod
    def other_way(caption: str) -> str:
        """The same scene described from the other shape ("a red square left
        of a blue circle" -> "a blue circle right of a red square"); a
        caption names either shape first, so both are right."""
        words = caption.split()
        if len(words) < 7 or words[0] != "a" or "a" not in words[1:]:
            return caption
        k = words.index("a", 1)
        flip = {"left": "right", "right": "left", "above": "below", "below": "above"}
        relation = [flip.get(w, w) for w in words[3:k]]
        return " ".join(words[k:] + relation + words[:3])

    def sample(self, split: str, index: int, seed: int) -> tuple[torch.Tensor, list]:
        """One image [3, H, W] and its caption's word ids (with <eos>)."""
        g = _generator(seed, split, index)
        draw = lambda k: int(torch.randint(k, (), generator=g))  # noqa: E731
        n = self.img_size
        objects = [(draw(len(SHAPES)), draw(len(COLOURS))) for _ in range(2)]
        vertical, first_is_second_cell = draw(2), draw(2)
        image = torch.randn(3, n, n, generator=g) * self.noise
        for cell, (shape, colour) in enumerate(objects):
            r = float(torch.empty(()).uniform_(n * 0.13, n * 0.19, generator=g))
            along, across = ((cell + 0.5) * n / 2 - 0.5,
                             (n - 1) / 2 + float(torch.empty(()).uniform_(-n / 10, n / 10,
                                                                           generator=g)))
            cx, cy = (across, along) if vertical else (along, across)
            intensity = float(torch.empty(()).uniform_(0.7, 1.0, generator=g))
            image[colour][shape_mask(n, shape, cx, cy, r)] += intensity
        first, second = (objects[1], objects[0]) if first_is_second_cell else objects
        relation = (("below",) if vertical else ("right", "of")) if first_is_second_cell \
            else (("above",) if vertical else ("left", "of"))
        words = ["a", COLOURS[first[1]], SHAPES[first[0]], *relation,
                 "a", COLOURS[second[1]], SHAPES[second[0]]]
        return image, [_WORD_ID[w] for w in words] + [EOS_ID]

    def global_batch(self, split: str, iteration: int, global_batch_size: int, seed: int,
                     first_sample: int | None = None):
        """Samples ``first_sample ...`` (default ``iteration * gbs``) of `split`."""
        from ..models.vlm import IGNORE_INDEX, combined_labels

        start = iteration * global_batch_size if first_sample is None else first_sample
        pairs = [self.sample(split, start + k, seed) for k in range(global_batch_size)]
        tokens = torch.full((global_batch_size, self.text_length), PAD_ID, dtype=torch.int64)
        for row, (_, words) in enumerate(pairs):
            tokens[row, 0] = BOS_ID if self.text_only else IMAGE_ID
            tokens[row, 1:1 + len(words)] = torch.tensor(words)
        if self.text_only:
            labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], PAD_ID)], 1)
            return tokens, labels.masked_fill(labels == PAD_ID, IGNORE_INDEX)
        labels = combined_labels(tokens, IMAGE_ID, self.num_image_tokens, ignore_ids=(PAD_ID,))
        return (torch.stack([p[0] for p in pairs]), tokens), labels

