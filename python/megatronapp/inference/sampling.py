"""Choosing the next token: greedy, temperature, top-k and top-p (nucleus).

:func:`choose` works on one row of full-vocabulary logits (gathered over the
tensor group); the draw comes from the request's own ``torch.Generator``, so
a request with a seed gets the same tokens whatever else is in its batch and
whatever the tensor/pipeline layout (the logits being the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "choose"]


@dataclass
class SamplingParams:
    """How one request generates (OpenAI's completion fields, and top_k)."""

    max_tokens: int = 16
    #: 0: greedy (the most likely token); otherwise logits / temperature
    temperature: float = 1.0
    #: keep the k most likely tokens (0: all)
    top_k: int = 0
    #: keep the smallest set of most likely tokens whose probability reaches p (1: all)
    top_p: float = 1.0
    #: the request's generator seed (None: drawn from the server's)
    seed: int | None = None
    #: strings that end the completion (not included in it)
    stop: list = field(default_factory=list)
    #: keep going after the end-of-document token
    ignore_eos: bool = False

    def check(self, limit: int) -> None:
        """ValueError naming the field when a value is out of range; `limit`:
        the most tokens a request may ask for."""
        if not 1 <= self.max_tokens <= limit:
            raise ValueError(f"max_tokens must be in [1, {limit}], got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def choose(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[int, float]:
    """(token, its log-probability under the model) for `logits` [V] (float)."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0.0:
        token = int(torch.argmax(logits))
        return token, float(logp[token])
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        p_sorted, order = probs.sort(descending=True)
        before = p_sorted.cumsum(0) - p_sorted  # mass of the more likely tokens
        drop = order[before >= params.top_p]  # the first token always stays
        probs = probs.index_fill(0, drop, 0.0)
        probs = probs / probs.sum()
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])
