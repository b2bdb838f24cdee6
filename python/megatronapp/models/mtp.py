"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron-LM's ``--mtp-num-layers
--mtp-loss-scaling-factor``).

Depth k = 1..D predicts the token k + 1 places ahead. Sequential modules on
the last pipeline stage, each sharing the model's embedding and output layer:

    h^0   = the main model's last hidden states (before its final norm)
    h'^k  = W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]       (2h -> h)
    h^k   = TransformerLayer_k(h'^k)
    L^k   = CE(Output(Norm_k(h^k_i)), t_{i+k+1}) over the positions with a target
    loss  = L_LM + (--mtp-loss-scaling-factor / D) * sum_k L^k

The tokens t_{i+k} and targets come from the labels (the tokens shifted by
one), shifted k - 1 and k places; the last k positions have no target and
are masked. Under context parallelism the shifts are taken on the whole
sequences before the zigzag split (:func:`mtp_targets`), and the MTP layers'
attention is the model's (ring / all-to-all over the context group). The
reported loss stays the language-model loss: the MTP terms enter through
the gradient only (:class:`AddToGradient`), and their mean is reported on
its own (``mtp_loss``). The projection W_k is whole on every
tensor rank (under sequence parallelism it runs on the rank's sequence shard,
its gradient a partial sum over the tensor group); the transformer layer is
the model's (MoE when the last decoder layer is).
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel import DuplicatedLinear, mappings, vocab_parallel_cross_entropy
from .gpt import (
    MTP_LAYER,
    GPTConfig,
    TransformerLayer,
    make_norm,
    mark_sequence_parallel,
    normal_init,
)

__all__ = ["AddToGradient", "MTPLayer", "mtp_loss", "mtp_targets"]


class AddToGradient(torch.autograd.Function):
    """``value`` forward; backward also sends the incoming gradient to
    `extra`, as if ``value + extra`` had been returned (Megatron's
    MTPLossAutoScaler): an auxiliary loss trained without being reported."""

    @staticmethod
    def forward(ctx, value, extra):
        if value.dim() or extra.dim():
            raise ValueError("AddToGradient takes two scalar losses")
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        return g, g


class MTPLayer(nn.Module):
    """One depth: the norms, the 2h -> h projection, a transformer layer and
    its final norm (the output layer is the model's)."""

    def __init__(self, cfg: GPTConfig, state, depth: int):
        super().__init__()
        sp = cfg.sequence_parallel and state.tp_size > 1
        self.depth = depth
        self.enorm, self.hnorm = make_norm(cfg), make_norm(cfg)
        mark_sequence_parallel(self.enorm, cfg.sequence_parallel)
        mark_sequence_parallel(self.hnorm, cfg.sequence_parallel)
        self.eh_proj = DuplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, sequence_parallel=sp,
                                        init_method=normal_init(cfg.init_method_std),
                                        parallel_state=state)
        # the decoder's kind of layer (MoE if its last layer is), numbered after it
        self.layer = TransformerLayer(cfg, state, cfg.num_layers + depth - 1)
        self.final_layernorm = make_norm(cfg)
        mark_sequence_parallel(self.final_layernorm, cfg.sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.layer(x)


def mtp_targets(labels: torch.Tensor, depths: int, cp_size: int = 1, cp_rank: int = 0,
                documents: torch.Tensor | None = None) -> list:
    """Per depth k = 1..`depths`: (input ids t_{i+k}, targets t_{i+k+1}, the
    mask [b, s] of the positions that have a target, the loss divisor), from
    the whole sequences' `labels` [b, s] (the tokens shifted by one): the
    labels shifted k - 1 and k places, the last k positions masked. With
    context parallelism, this context rank's zigzag parts of each (the shift
    crosses the chunks, so it is taken before the split); the divisor is then
    this rank's share, the kept targets / cp. `documents` [b, s + 1] (packed
    documents): the document of each input token and of the last label; a
    position whose target lies in another document than its own token is
    masked too (no prediction across a document's end)."""
    from .context_parallel import zigzag_split

    b, s = labels.shape
    pos = torch.arange(s, device=labels.device)
    out = []
    for k in range(1, depths + 1):
        ids, tgt = torch.roll(labels, -(k - 1), dims=1), torch.roll(labels, -k, dims=1)
        keep = (pos < s - k).expand(b, s)
        if documents is None:
            divisor = b * (s - k) / cp_size
        else:
            keep = keep & (documents[:, :s] == torch.roll(documents, -(k + 1), dims=1)[:, :s])
            divisor = max(float(keep.sum()), 1.0) / cp_size
        out.append((zigzag_split(ids, cp_size, cp_rank, 1), zigzag_split(tgt, cp_size, cp_rank, 1),
                    zigzag_split(keep, cp_size, cp_rank, 1), divisor))
    return out


def mtp_loss(model, hidden: torch.Tensor, labels: torch.Tensor, targets: list | None = None):
    """(the scaled MTP loss to train, [L^1 .. L^D] detached) of the model's
    MTP layers for the last hidden states `hidden` [s(/tp), b, h] and
    `labels` [b, s]. With context parallelism (the model's cp_size > 1),
    `labels` are this rank's zigzag parts and `targets` must be
    :func:`mtp_targets` of the whole sequences; each depth's loss is then this
    rank's share of the mean over the b (S - k) targets of the whole length S,
    times cp (the context ranks' losses and gradients are averaged, as the
    language model's). Packed documents: `targets` from :func:`mtp_targets`
    with the documents (and the model's forward's PackedSeq active), each
    depth's loss the mean over the targets left in the documents."""
    cfg = model.config
    cp = getattr(model, "cp_size", 1)
    if targets is None:
        if cp > 1:
            raise ValueError("mtp_loss under context parallelism needs targets=mtp_targets(the "
                             "whole sequences' labels, depths, cp_size, cp_rank): the shifted "
                             "tokens cross the zigzag chunks")
        targets = mtp_targets(labels, len(model.mtp))
    if len(targets) != len(model.mtp):
        raise ValueError(f"{len(targets)} MTP targets for {len(model.mtp)} depths")
    losses = []
    h = hidden
    for layer, (ids, tgt, keep, divisor) in zip(model.mtp, targets, strict=True):
        e = model.word_embeddings(ids).transpose(0, 1).contiguous()  # [s/cp, b, h]
        if cfg.sequence_parallel:
            e = mappings.scatter_to_sequence_parallel_region(e, model.group)
        h = layer(h, e)
        logits = model.output_logits(layer.final_layernorm(h))  # [s/cp, b, V/tp]
        per_token = vocab_parallel_cross_entropy(logits.float(), tgt.transpose(0, 1),
                                                 group=model.group)
        keep = keep.to(per_token.dtype).t()  # [s/cp, b] as per_token
        losses.append((per_token * keep).sum() / divisor)
    total = torch.stack(losses).sum() * (cfg.mtp_loss_scaling_factor / len(losses))
    return total, [x.detach() for x in losses]


MTP_LAYER[:] = [MTPLayer]
