"""Packed sequences: documents concatenated into one training sequence, kept
apart (Megatron-LM's ``--reset-position-ids``, ``--reset-attention-mask``,
``--eod-mask-loss``, ``--calculate-per-token-loss``).

A document ends with its end-of-document token (the EOD belongs to the
document it ends). From a microbatch's tokens:

* :func:`document_ids` numbers each token's document; under
  ``--reset-attention-mask`` a query attends only to earlier keys of its own
  document (:func:`attention_mask`);
* :func:`reset_positions`: each document's positions start again at 0 (the
  learned position table and RoPE both read them);
* :func:`loss_mask`: ``--eod-mask-loss`` drops the loss where the input is an
  EOD (predicting the next document's first token from the previous one).

The layers read the microbatch's :class:`PackedSeq` from :func:`current`,
which the model's forward sets (:func:`active`) for the duration of its call;
recomputation (``tensor_parallel.checkpoint``) captures it with the RNG
states and sets it again for the recompute, so pipeline schedules that
interleave microbatches and recompute in backward see the right one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["PackedSeq", "MaskedTarget", "active", "current", "document_ids", "reset_positions",
           "loss_mask", "attention_mask"]


@dataclass
class PackedSeq:
    """What the layers of one microbatch's forward need to keep documents apart."""

    #: [b, S] each token's document over the whole sequences, in sequence
    #: order (every context rank holds all of it); None: attention crosses documents
    segment_ids: torch.Tensor | None = None
    #: [b, s] the positions of this rank's tokens (its zigzag chunks under
    #: context parallelism); None: 0, 1, 2, ... as without packing
    position_ids: torch.Tensor | None = None

    def to(self, device) -> PackedSeq:
        return PackedSeq(*(None if t is None else t.to(device)
                           for t in (self.segment_ids, self.position_ids)))


@dataclass
class MaskedTarget:
    """A microbatch's labels with its loss mask: the loss is
    ``sum(cross-entropy x mask) / divisor`` (training/step.py chooses the
    divisor so that the global batch's loss is Megatron-LM's: per microbatch
    under --eod-mask-loss, per token of the whole batch under
    --calculate-per-token-loss)."""

    labels: torch.Tensor
    mask: torch.Tensor
    divisor: float
    #: --mtp-num-layers (training): models.mtp.mtp_targets with the documents
    mtp: list | None = None
    #: the microbatch's PackedSeq, for the MTP layers' attention and positions
    packed: PackedSeq | None = None


_CURRENT: list = [None]


def current() -> PackedSeq | None:
    return _CURRENT[0]


@contextlib.contextmanager
def active(packed: PackedSeq | None):
    prev, _CURRENT[0] = _CURRENT[0], packed
    try:
        yield
    finally:
        _CURRENT[0] = prev


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: the index of each token's document (an EOD ends its own)."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def reset_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: each token's position within its document."""
    s = tokens.shape[-1]
    idx = torch.arange(s, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = tokens[..., :-1] == eod
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - first


def loss_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] float32: 0 where the input token is an EOD, else 1."""
    return (tokens != eod).float()


def attention_mask(segment_ids: torch.Tensor, q_index: torch.Tensor,
                   k_index: torch.Tensor) -> torch.Tensor:
    """[b, 1, len(q_index), len(k_index)] bool, True where a query may attend:
    causal (key position <= query position) and within its document;
    `q_index`/`k_index` are the positions in the whole sequence."""
    causal = k_index.unsqueeze(0) <= q_index.unsqueeze(1)
    same = segment_ids[:, q_index].unsqueeze(2) == segment_ids[:, k_index].unsqueeze(1)
    return (same & causal).unsqueeze(1)
