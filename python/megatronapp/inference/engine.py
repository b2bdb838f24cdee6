"""Batched, KV-cached generation over tensor- and pipeline-parallel ranks.

Every rank of a model replica (its tensor x pipeline ranks) calls
:meth:`InferenceEngine.generate` with the same requests. One forward per
step: the prompts' prefill first (left-padded to one length, kv_cache), then
one token per sequence. A stage receives the previous stage's hidden states
[n, b, h] (point-to-point), runs its layers with the cache active and sends
them on; the last stage gathers the last column's logits over the tensor
group, and its first tensor rank chooses each sequence's token
(:func:`~megatronapp.inference.sampling.choose`, the request's own
generator) and decides which sequences are finished (length, end of
document, a stop string). It broadcasts (token, log-probability, finished)
to the replica, so every rank keeps the same batch; finished sequences
leave the batch and the cache.

Sequence parallelism is off (one new token cannot be split over the tensor
group; the weights are the same), as in Megatron-LM's inference.
"""

from __future__ import annotations

import torch.distributed as dist

import torch

from .. import packed_sequence
from ..models import kv_cache
from .sampling import SamplingParams, choose

__all__ = ["InferenceEngine", "Completion"]


class Completion(dict):
    """{"tokens", "logprobs", "finish_reason" ("length" or "stop")}."""


class InferenceEngine:
    """`model`: this rank's stage (a GPTModel in eval mode, built with
    ``pre_process`` / ``post_process`` for its place in the pipeline);
    `state`: the ParallelState; `vocab`: the tokenizer's vocabulary (ids at
    or above it, the padding rows of the embedding, are never chosen); `eod`:
    the end-of-document id (None: none); `stop_check(tokens, stop)`: on the
    choosing rank, True when a request's tokens so far contain one of its
    stop strings."""

    def __init__(self, model, state, *, vocab: int | None = None, eod: int | None = None,
                 stop_check=None):
        self.model, self.state = model.eval(), state
        self.cfg = model.config
        if self.cfg.sequence_parallel:
            raise ValueError("generation needs a model built without sequence parallelism "
                             "(the weights are the same: build it with sequence_parallel=False)")
        if state.cp_size > 1:
            raise ValueError("generation runs without context parallelism")
        self.vocab, self.eod, self.stop_check = vocab, eod, stop_check
        self.first, self.last = state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
        pp = state.group_ranks.get("pp", [dist.get_rank() if dist.is_initialized() else 0])
        self.prev = pp[state.pp_rank - 1] if not self.first else None
        self.next = pp[state.pp_rank + 1] if not self.last else None
        replica = state.group_ranks.get("mp", pp)
        self.chooser = next(
            (r for r in replica if state.grid.coord(r).pp == state.pp_size - 1
             and state.grid.coord(r).tp == 0), replica[-1])
        me = dist.get_rank() if dist.is_initialized() else 0
        self.is_chooser = me == self.chooser
        self.group = state.model_group if len(replica) > 1 else None
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def check(self, prompt: list, params: SamplingParams) -> None:
        """Raises ValueError unless the request can run on this model."""
        if len(prompt) == 0:
            raise ValueError("generate: a prompt has no tokens")
        if len(prompt) + params.max_tokens > self.cfg.seq_length:  # positions stay in range
            raise ValueError(f"a prompt of {len(prompt)} tokens and max_tokens "
                             f"{params.max_tokens} exceed the model's seq_length "
                             f"{self.cfg.seq_length}")

    @torch.no_grad()
    def generate(self, prompts: list, params: list, on_token=None, admit=None) -> list:
        """`prompts`: token-id lists (non-empty); `params`: one SamplingParams
        each. `on_token(i, token, logprob, finish_reason or None)` is called on
        every rank as each token is chosen. Returns a Completion per request.

        Continuous batching: `admit(active)`, when given, is called on every
        rank before each decoding step with the number of sequences in the
        batch, and returns ``(prompts, params)`` that join the batch now (the
        same on every rank: the server's driver broadcasts them). Their
        prompts are prefilled and they decode with the others from then on;
        their Completions follow the earlier ones in the returned list, and
        `on_token` numbers them the same way."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError("generate: give one SamplingParams per prompt, and at least one")
        out, all_params, gens, rows = [], [], [], []
        cache = kv_cache.KVCache(0, 0, self.device)
        tokens = torch.zeros(0, 1, dtype=torch.long)
        new = (prompts, params)
        while True:
            if new and new[0]:
                cache, tokens = self._join(cache, tokens, new, rows, out, all_params, gens,
                                           on_token)
            if not rows:
                return out
            cache.step(torch.ones(len(rows), 1, dtype=torch.bool))
            seen = cache.valid[:, :cache.length + cache.new]
            pos = kv_cache.position_ids(seen)[:, cache.length:]
            logits = self._forward(tokens, pos, cache)
            cache.advance()
            tokens = self._take(logits, cache, rows, out, all_params, gens, on_token)
            if admit is not None:  # a batch that others join: no ever-growing columns
                cache.trim_left()
            new = admit(len(rows)) if admit is not None and rows else None

    def _join(self, cache, tokens, new, rows, out, all_params, gens, on_token):
        """Prefills the requests `new` = (prompts, params) in a cache laid out
        like `cache` (widened on the left if a prompt is longer than its
        filled columns), chooses their first tokens and appends the rows that
        go on. Returns the batch's cache and next tokens."""
        prompts, params = new
        if len(prompts) != len(params):
            raise ValueError("generate: give one SamplingParams per prompt")
        for p, sp in zip(prompts, params, strict=True):
            self.check(p, sp)
        width = max(cache.length, max(len(p) for p in prompts))
        left = [all_params[i].max_tokens - len(out[i]["tokens"]) for i in rows]
        capacity = max([cache.capacity] + [width + n for n in left]
                       + [width + sp.max_tokens for sp in params])
        if (width, capacity) != (cache.length, cache.capacity):
            cache.pad_left(width - cache.length, capacity)
        first = len(out)
        for sp in params:
            out.append(Completion(tokens=[], logprobs=[], finish_reason=None))
            all_params.append(sp)
            gens.append(self._generator(sp) if self.is_chooser else None)
        b = len(prompts)
        ids = torch.zeros(b, width, dtype=torch.long)
        valid = torch.zeros(b, width, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: every sequence ends at the last column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[i, width - len(p):] = True
        joining = kv_cache.KVCache(b, capacity, self.device)
        joining.step(valid)
        pos = kv_cache.position_ids(joining.valid[:, :width])
        logits = self._forward(ids, pos, joining)
        joining.advance()
        new_rows = list(range(first, first + b))
        picked = self._take(logits, joining, new_rows, out, all_params, gens, on_token)
        if new_rows:
            cache.append(joining)
            rows.extend(new_rows)
            tokens = torch.cat([tokens, picked])
        return cache, tokens

    def _take(self, logits, cache, rows, out, all_params, gens, on_token) -> torch.Tensor:
        """Chooses a token for every row of `rows` (the batch rows of
        `cache`), hands it on and drops the finished rows from `rows` and the
        cache; returns the next tokens [len(rows), 1] of those left."""
        picked = self._choose(logits, rows, all_params, gens, out)
        kept = []
        for j, i in enumerate(rows):
            token, logprob, finished = int(picked[j, 0]), float(picked[j, 1]), int(picked[j, 2])
            out[i]["tokens"].append(token)
            out[i]["logprobs"].append(logprob)
            reason = (None, "length", "stop")[finished]
            out[i]["finish_reason"] = reason
            if on_token is not None:
                on_token(i, token, logprob, reason)
            if reason is None:
                kept.append(j)
        if len(kept) < len(rows):
            cache.keep(torch.tensor(kept, dtype=torch.long))
            rows[:] = [rows[j] for j in kept]
            picked = picked[kept]
        return picked[:, :1].long()

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.temperature == 0.0:
            return None
        g = torch.Generator()
        if params.seed is not None:
            g.manual_seed(params.seed)
        else:
            g.seed()
        return g

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor | None:
        """This stage's part of one forward; the last stage returns the last
        column's full-vocabulary logits [b, V] (float32), the others None."""
        b, n = tokens.shape
        if self.first:
            x = tokens.to(self.device)
        else:
            x = torch.empty(n, b, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.prev)
        with packed_sequence.active(packed_sequence.PackedSeq(position_ids=pos.to(self.device))), \
                kv_cache.active(cache):
            y = self.model(x)
        if not self.last:
            dist.send(y.contiguous(), dst=self.next)
            return None
        logits = y[:, -1]  # [b, V/tp]
        if self.state.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.state.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.state.tensor_group)
            logits = torch.cat(parts, dim=-1)
        return logits.float().cpu()

    def _choose(self, logits, rows, params, gens, out) -> torch.Tensor:
        """[len(rows), 3] float64 (token, log-probability, 0 / 1 length / 2
        stop), chosen on the choosing rank and broadcast to the replica."""
        picked = torch.zeros(len(rows), 3, dtype=torch.float64)
        if self.is_chooser:
            if self.vocab is not None and self.vocab < logits.shape[-1]:
                logits[:, self.vocab:] = float("-inf")
            for j, i in enumerate(rows):
                p = params[i]
                token, logprob = choose(logits[j], p, gens[i])
                done = len(out[i]["tokens"]) + 1 >= p.max_tokens
                stop = ((token == self.eod and not p.ignore_eos) or (
                    self.stop_check is not None and p.stop
                    and self.stop_check(out[i]["tokens"] + [token], p.stop)))
                picked[j] = torch.tensor([token, logprob, 2 if stop else 1 if done else 0],
                                         dtype=torch.float64)
        if self.group is not None:
            dist.broadcast(picked, src=self.chooser, group=self.group)
        return picked
