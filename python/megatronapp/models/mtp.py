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
are masked. The reported loss stays the language-model loss: the MTP terms
enter through the gradient only (:class:`AddToGradient`), and their mean is
reported on its own (``mtp_loss``). The projection W_k is whole on every
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

__all__ = ["AddToGradient", "MTPLayer", "mtp_loss"]


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


def mtp_loss(model, hidden: torch.Tensor, labels: torch.Tensor):
    """(the scaled MTP loss to train, [L^1 .. L^D] detached) of the model's
    MTP layers for the last hidden states `hidden` [s(/tp), b, h] and
    `labels` [b, s]."""
    cfg = model.config
    s = labels.shape[1]
    losses = []
    h = hidden
    for k, layer in enumerate(model.mtp, 1):
        ids = torch.roll(labels, -(k - 1), dims=1)
        e = model.word_embeddings(ids).transpose(0, 1).contiguous()  # [s, b, h]
        if cfg.sequence_parallel:
            e = mappings.scatter_to_sequence_parallel_region(e, model.group)
        h = layer(h, e)
        logits = model.output_logits(layer.final_layernorm(h))  # [s, b, V/tp]
        target = torch.roll(labels, -k, dims=1).transpose(0, 1)
        per_token = vocab_parallel_cross_entropy(logits.float(), target, group=model.group)
        keep = (torch.arange(s, device=labels.device) < s - k).to(per_token.dtype)
        losses.append((per_token * keep.unsqueeze(1)).sum() / (keep.sum() * labels.shape[0]))
    total = torch.stack(losses).sum() * (cfg.mtp_loss_scaling_factor / len(losses))
    return total, [x.detach() for x in losses]


MTP_LAYER[:] = [MTPLayer]
