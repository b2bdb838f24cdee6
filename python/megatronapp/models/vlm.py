"""A LLaVA-style vision-language model from the same parallel layers.

    images [b, C, H, W] ──ViT encoder──> [b, P(+1), hv] ──MLP projector──> [b, P, h]
    tokens [b, T] (one image token each) ──word embeddings──> [b, T, h]
    the image token's embedding is replaced by the P image embeddings:
    [b, S = T - 1 + P, h] + positions ──GPT decoder──> logits [b, S, V/tp]

As Megatron-Core's ``LLaVAModel``: a :class:`~megatronapp.models.ViTModel`
encoder without a head (the class token dropped with
``drop_vision_class_token``), Megatron's MLP projector (a column-parallel
``fc1``, GELU, a row-parallel ``fc2``: its output is whole on every tensor
rank) and a :class:`~megatronapp.models.GPTModel` decoder, which this class
extends, so its decoder layers, pipeline split, tied embeddings, sequence
parallelism and checkpoint names are the GPT's. The encoder and projector
live on the first pipeline stage (``pre_process``).

Labels are in the combined sequence: position j is trained to predict the
token at position j + 1 when that is a text token, and ``IGNORE_INDEX``
elsewhere (:func:`combined_labels`); the loss is averaged over text targets
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F

import torch
from torch import nn

from ..parallel_state import ParallelState
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy
from ..tensor_parallel.utils import divide, resolve_state
from .gpt import GPTConfig, GPTModel, seeded
from .vit import ViTConfig, ViTModel

__all__ = ["IGNORE_INDEX", "VLMConfig", "VLM", "combined_labels", "masked_token_loss"]

IGNORE_INDEX = -100  #: a label no loss is computed for (as torch's cross_entropy)


@dataclass
class VLMConfig:
    """The decoder (``language``), the encoder (``vision``, no head) and how
    they meet. ``language.seq_length`` is the combined sequence S."""

    language: GPTConfig
    vision: ViTConfig = field(default_factory=ViTConfig)
    image_token_id: int = 3  #: the text token the image embeddings replace
    drop_vision_class_token: bool = False  #: Megatron's --disable-vision-class-token
    projector_ffn_hidden_size: int | None = None  #: default language.hidden_size

    def __post_init__(self):
        if self.vision.num_classes is not None:
            raise ValueError("the VLM's vision encoder has no classification head: "
                             "set vision.num_classes=None")
        if self.projector_ffn_hidden_size is None:
            self.projector_ffn_hidden_size = self.language.hidden_size
        if not 0 <= self.image_token_id < self.language.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} is outside the vocabulary "
                             f"[0, {self.language.vocab_size})")
        if self.text_length < 1:
            raise ValueError(
                f"seq_length {self.language.seq_length} has no room for text after the "
                f"{self.num_image_tokens} image tokens: use seq_length >= "
                f"{self.num_image_tokens + 1}")

    @property
    def num_image_tokens(self) -> int:
        """P: the encoder's patches (+ the class token unless dropped)."""
        return self.vision.seq_length - (1 if self.drop_vision_class_token else 0)

    @property
    def text_length(self) -> int:
        """T: the text tokens per sample, the image token included (S - P + 1)."""
        return self.language.seq_length - self.num_image_tokens + 1

    # the fields the training edge reads (progress line, tracing, scope, checkpoints)
    vocab_size = property(lambda self: self.language.vocab_size)
    hidden_size = property(lambda self: self.language.hidden_size)
    num_layers = property(lambda self: self.language.num_layers)
    num_attention_heads = property(lambda self: self.language.num_attention_heads)
    ffn_hidden_size = property(lambda self: self.language.ffn_hidden_size)
    seq_length = property(lambda self: self.language.seq_length)
    sequence_parallel = property(lambda self: self.language.sequence_parallel)
    encoder_num_layers = property(lambda self: self.vision.num_layers)
    img_h = property(lambda self: self.vision.img_h)
    img_w = property(lambda self: self.vision.img_w)
    patch_dim = property(lambda self: self.vision.patch_dim)

    def num_parameters(self) -> int:
        hv, h, f = self.vision.hidden_size, self.language.hidden_size, \
            self.projector_ffn_hidden_size
        return (self.language.num_parameters() + self.vision.num_parameters()
                + (hv * f + f) + (f * h + h))


class MultimodalProjector(nn.Module):
    """Megatron's ``mlp`` projector: fc1 (column-parallel) -> GELU -> fc2
    (row-parallel, all-reduced: the output is whole on every tensor rank)."""

    def __init__(self, in_size: int, ffn: int, out_size: int, state: ParallelState, std: float):
        super().__init__()
        divide(ffn, state.tp_size, "projector ffn_hidden_size")
        init = lambda t: nn.init.normal_(t, 0.0, std)  # noqa: E731
        self.fc1 = ColumnParallelLinear(in_size, ffn, init_method=init, parallel_state=state)
        self.fc2 = RowParallelLinear(ffn, out_size, input_is_parallel=True, init_method=init,
                                     parallel_state=state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VLM(GPTModel):
    """``forward((images [b, C, H, W], tokens [b, T]), labels [b, S] | None)``
    on the first stage; later stages take the hidden states as the GPT's do.
    With labels: the per-position loss [b, S] (0 where the label is
    ``IGNORE_INDEX``); without: the vocabulary-sharded logits [b, S, V/tp]."""

    def __init__(self, config: VLMConfig, *, parallel_state: ParallelState | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None, seed: int | None = None):
        state = resolve_state(parallel_state)
        super().__init__(config.language, parallel_state=state, pre_process=pre_process,
                         post_process=post_process, layer_numbers=layer_numbers, seed=seed)
        self.vlm_config = config
        self.vision = self.projector = None
        if pre_process:
            base = torch.initial_seed() if seed is None else seed
            # its own seed stream: the encoder is not drawn like the decoder
            self.vision = ViTModel(config.vision, parallel_state=state,
                                   seed=(base * 7_919 + 104_729) % (2**63 - 1))
            for m in self.vision.modules():  # a scope's layer numbers are the decoder's
                if hasattr(m, "tapped"):
                    m.tapped = False
            with seeded(base, config.language.num_layers + 1):
                self.projector = MultimodalProjector(
                    config.vision.hidden_size, config.projector_ffn_hidden_size,
                    config.language.hidden_size, state, config.language.init_method_std)

    def embed(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's token embeddings [b, S, h]: each row's image token
        replaced by its P projected image embeddings."""
        cfg = self.vlm_config
        b, t = tokens.shape
        if t != cfg.text_length:
            raise ValueError(f"expected {cfg.text_length} text tokens per sample (seq_length "
                             f"{cfg.language.seq_length} - {cfg.num_image_tokens} image tokens "
                             f"+ 1), got {t}")
        if images.shape[0] != b:
            raise ValueError(f"{images.shape[0]} images for {b} token rows")
        is_image = tokens == cfg.image_token_id
        if not bool((is_image.sum(1) == 1).all()):
            raise ValueError(f"every token row needs exactly one image token "
                             f"({cfg.image_token_id}); counts per row: "
                             f"{is_image.sum(1).tolist()}")
        features = self.vision(images)  # [b, P(+1), hv]
        if cfg.drop_vision_class_token:
            features = features[:, 1:]
        image_emb = self.projector(features)  # [b, P, h]
        text_emb = self.word_embeddings(tokens)  # [b, T, h]
        text_idx, img_idx, on_image = _placement(is_image, cfg.num_image_tokens)
        h = text_emb.shape[-1]
        from_text = text_emb.gather(1, text_idx.unsqueeze(-1).expand(-1, -1, h))
        from_image = image_emb.to(text_emb.dtype).gather(1, img_idx.unsqueeze(-1).expand(-1, -1, h))
        return torch.where(on_image.unsqueeze(-1), from_image, from_text)

    def forward(self, x, labels: torch.Tensor | None = None):
        if not self.pre_process:
            return self._loss_or_logits(super().forward(x), labels)
        if not isinstance(x, (tuple, list)) or len(x) != 2:
            raise ValueError("the VLM's first stage takes (images, tokens)")
        images, tokens = x
        return self._loss_or_logits(super().forward(None, decoder_input=self.embed(images, tokens)),
                                    labels)

    def _loss_or_logits(self, out, labels):
        if labels is None or not self.post_process:
            return out
        return masked_token_loss(out, labels, self.group, reduction="none")


def _placement(is_image: torch.Tensor, p: int):
    """For each combined position j of each row (image token at k): the text
    index it takes (j < k: j; j >= k + P: j - P + 1), the image index (j - k)
    and whether it is an image position."""
    b, t = is_image.shape
    k = is_image.int().argmax(1, keepdim=True)  # [b, 1]
    j = torch.arange(t - 1 + p, device=is_image.device).unsqueeze(0)  # [1, S]
    on_image = (j >= k) & (j < k + p)
    text_idx = torch.where(j < k, j, j - p + 1).clamp(0, t - 1)
    img_idx = (j - k).clamp(0, p - 1)
    return text_idx, img_idx, on_image


def combined_labels(tokens: torch.Tensor, image_token_id: int, num_image_tokens: int,
                    ignore_ids=()) -> torch.Tensor:
    """Labels [b, S] for text rows [b, T] (one image token each): position j
    predicts the token at combined position j + 1 when that is a text token
    not in `ignore_ids` (e.g. padding), else ``IGNORE_INDEX``."""
    is_image = tokens == image_token_id
    text_idx, _, on_image = _placement(is_image, num_image_tokens)
    ids = tokens.gather(1, text_idx)
    ignored = on_image
    for i in ignore_ids:
        ignored = ignored | (ids == i)
    ids = torch.where(ignored, torch.full_like(ids, IGNORE_INDEX), ids)
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)


def masked_token_loss(logits: torch.Tensor, labels: torch.Tensor, group,
                      reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits [b, S, V/tp] (in fp32 at least) against
    labels [b, S], skipping ``IGNORE_INDEX``: per position [b, S] (0 where
    ignored) with ``reduction="none"``, else the mean over counted positions."""
    labels = labels.to(logits.device)
    keep = labels != IGNORE_INDEX
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    loss = vocab_parallel_cross_entropy(logits.transpose(0, 1),
                                        torch.where(keep, labels, 0).transpose(0, 1),
                                        group=group).transpose(0, 1) * keep
    if reduction == "none":
        return loss
    return loss.sum() / keep.sum().clamp(min=1)
