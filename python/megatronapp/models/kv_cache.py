"""The key/value cache of incremental decoding.

A batch's sequences are left-padded to one length, so every sequence's n-th
new token sits at the same column: the cache holds, per attention module,
keys and values [b, groups, capacity, d] (before grouped-query expansion, so
GQA caches only its groups), the columns filled so far (:attr:`length`) and
which columns are real tokens (:attr:`valid`). A forward of n new tokens
(the prompts' prefill, then one token per step) appends their keys and
values at columns [length, length + n) and attends with the mask

    key j visible to query i  <=>  valid[j] and j <= length + i   (causal)

plus each column to itself, so a padding query attends to something (its
output is never used; without it a row of -inf would turn into NaN values
that later layers' masked products would spread, since 0 x NaN = NaN).
Positions (RoPE's angles, the learned table's rows) count real tokens only:
:func:`position_ids`.

The model's attention modules read the cache from :func:`current` while a
:func:`active` block runs; :meth:`KVCache.step` marks the columns of the next
forward. Finished sequences leave the batch with :meth:`KVCache.keep`; new
ones join it (continuous batching) with :meth:`KVCache.append`, their prompts
prefilled in a cache of their own laid out to the same columns
(:meth:`KVCache.pad_left` first makes room when a newcomer's prompt is longer
than the columns filled so far: more left padding changes no position), and
:meth:`KVCache.trim_left` drops the columns that became padding in every row.
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F

import torch

__all__ = ["KVCache", "active", "current", "position_ids"]

_CURRENT: list = [None]


def current() -> KVCache | None:
    return _CURRENT[0]


@contextlib.contextmanager
def active(cache: KVCache | None):
    prev, _CURRENT[0] = _CURRENT[0], cache
    try:
        yield
    finally:
        _CURRENT[0] = prev


def position_ids(valid: torch.Tensor) -> torch.Tensor:
    """[b, L] int64: each real token's index among its sequence's real tokens
    (padding columns get 0)."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


class KVCache:
    """Keys and values of every attention module of this rank's stage for a
    batch of `batch` sequences of at most `capacity` columns."""

    def __init__(self, batch: int, capacity: int, device=None):
        self.capacity, self.device = capacity, device
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0  #: columns filled by finished forwards
        self.new = 0  #: columns of the forward in progress
        self._kv: dict = {}  # id(module) -> (keys, values)

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def step(self, valid_new: torch.Tensor) -> None:
        """Before a forward of valid_new.shape[1] new columns ([b, n] bool:
        which are real tokens)."""
        n = valid_new.shape[1]
        if self.length + n > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} columns; {self.length} are "
                             f"filled and {n} more were asked for")
        self.valid[:, self.length:self.length + n] = valid_new.to(self.valid.device)
        self.new = n

    def advance(self) -> None:
        """After the forward: its columns are part of the cache."""
        self.length += self.new
        self.new = 0

    def extend(self, module, k: torch.Tensor, v: torch.Tensor):
        """Stores `module`'s keys and values of the new columns (k, v [b, g,
        n, d]) and returns all of its cached ones [b, g, length + n, d]."""
        n, end = k.shape[2], self.length + k.shape[2]
        if n != self.new:
            raise RuntimeError(f"KV cache: {n} new keys, but step() announced {self.new}")
        entry = self._kv.get(id(module))
        if entry is None:
            b, g, _, d = k.shape
            entry = (k.new_empty(b, g, self.capacity, d),
                     v.new_empty(b, v.shape[1], self.capacity, v.shape[3]))
            self._kv[id(module)] = entry
        keys, values = entry
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def mask(self) -> torch.Tensor:
        """[b, 1, n, length + n] bool: what each new column's query sees."""
        end = self.length + self.new
        q = torch.arange(self.length, end, device=self.valid.device)
        k = torch.arange(end, device=self.valid.device)
        causal = k[None, :] <= q[:, None]
        seen = causal[None] & self.valid[:, None, :end]
        return (seen | (k[None, :] == q[:, None])[None]).unsqueeze(1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """softmax(q k^T scale, masked) v for q [b, heads, n, d] against the
        cached k, v [b, heads, length + n, d]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask().to(q.device),
                                              scale=scale)

    def pad_left(self, columns: int, capacity: int) -> None:
        """Adds `columns` padding columns in front of every row and makes the
        capacity `capacity` (at least the filled columns)."""
        if self.new:
            raise RuntimeError("KV cache: pad_left() between step() and advance()")
        if capacity < self.length + columns:
            raise ValueError(f"KV cache: capacity {capacity} is below the "
                             f"{self.length + columns} columns it would hold")
        self._move(0, columns, capacity)

    def trim_left(self) -> int:
        """Drops the leading columns that are padding in every row (left by
        sequences that finished) so that a batch others keep joining does not
        grow without bound; returns how many. Positions do not change."""
        if self.new or not self.batch:
            return 0
        real = self.valid[:, :self.length].any(0)
        first = int(real.int().argmax()) if bool(real.any()) else self.length
        if first:
            self._move(first, 0, self.capacity)
        return first

    def _move(self, src: int, dst: int, capacity: int) -> None:
        """Moves the filled columns [src, length) to start at column `dst` of
        new storage of `capacity` columns, zeros elsewhere (masked padding,
        but 0 x NaN would be NaN)."""
        n = self.length - src
        valid = torch.zeros(self.batch, capacity, dtype=torch.bool, device=self.valid.device)
        valid[:, dst:dst + n] = self.valid[:, src:self.length]

        def moved(t):
            out = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
            out[:, :, dst:dst + n] = t[:, :, src:self.length]
            return out
        self._kv = {key: (moved(k), moved(v)) for key, (k, v) in self._kv.items()}
        self.valid, self.length, self.capacity = valid, dst + n, capacity

    def append(self, other: KVCache) -> None:
        """Adds `other`'s rows after this cache's; both must hold the same
        columns (length and capacity) and the same attention modules."""
        if (other.length, other.capacity) != (self.length, self.capacity) or self.new or \
                other.new:
            raise ValueError(f"KV cache: appending rows of {other.length}/{other.capacity} "
                             f"columns to {self.length}/{self.capacity}")
        if self.batch and set(other._kv) != set(self._kv):
            raise ValueError("KV cache: the appended rows come from other attention modules")
        self.valid = torch.cat([self.valid, other.valid])
        self._kv = {key: (torch.cat([self._kv[key][0], k]), torch.cat([self._kv[key][1], v]))
                    if key in self._kv else (k, v) for key, (k, v) in other._kv.items()}

    def keep(self, rows: torch.Tensor) -> None:
        """Keeps only the batch rows `rows` (int64 indices), in that order."""
        rows = rows.to(self.valid.device)
        self.valid = self.valid.index_select(0, rows)
        self._kv = {key: (kk.index_select(0, rows.to(kk.device)),
                          vv.index_select(0, rows.to(vv.device)))
                    for key, (kk, vv) in self._kv.items()}
