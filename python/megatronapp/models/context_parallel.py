"""Context parallelism: one sequence split over the ``cp`` ranks of a context
group (``initialize_model_parallel(..., context_parallel_size=cp)``).

Layout (Megatron-Core's causal load balancing): the sequence is cut into
``2 cp`` equal chunks and rank r holds chunks ``r`` and ``2 cp - 1 - r``
(:func:`zigzag_split` / :func:`zigzag_gather`), so every rank has the same
amount of causal attention work.

* :func:`ring_attention` (``--cp-comm-type p2p``): the key/value blocks go
  round the ring (asynchronous send/receive of the next block posted before
  the current block's attention runs); each rank merges its partial results
  by log-sum-exp. With the zigzag layout the first step is the rank's own
  causal block and every other step is exactly half a block of unmasked work
  (all queries against the first half of the visiting keys, or the second half
  of the queries against all of them). Backward goes round again and sends
  each block's dK/dV accumulator along with it, home after the last step.
  The block kernel is ``torch.ops.mapp.attn_block_fwd/bwd`` (C++, ATen: CPU and
  CUDA).
* :func:`ulysses_attention` (``--cp-comm-type a2a``, DeepSpeed-Ulysses): one
  all-to-all turns sequence shards into head shards (the whole sequence, heads
  / cp of them), causal attention runs locally, a second all-to-all turns it
  back. Needs the heads divisible by cp.

Both take and return ``[b, heads, s_local, d]`` in the zigzag layout.
"""

from __future__ import annotations

import math

import torch.distributed as dist

import torch

from .. import packed_sequence as _packed
from .. import trace as _trace

__all__ = ["zigzag_split", "zigzag_gather", "ring_attention", "ulysses_attention",
           "check_sequence"]


def check_sequence(seq_len: int, cp: int) -> None:
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x "
                         f"--context-parallel-size ({2 * cp}): context parallelism cuts the "
                         f"sequence into 2 x cp equal chunks; use a multiple of {2 * cp}")


def zigzag_split(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s chunks (r and 2cp-1-r) of `x` along `dim`."""
    check_sequence(x.shape[dim], cp)
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def zigzag_gather(parts: list, dim: int) -> torch.Tensor:
    """The full sequence from every rank's zigzag part (in rank order)."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks = [None] * (2 * cp)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim)
        chunks[r], chunks[2 * cp - 1 - r] = a, b
    return torch.cat(chunks, dim)


def _merge(out, lse, o, l_):
    """Log-sum-exp merge of partial attention results (in place on out/lse).
    A row that no key has reached yet on either side (lse -inf: possible with
    documents kept apart) stays empty instead of becoming NaN."""
    new = torch.logaddexp(lse, l_)
    keep, add = torch.exp(lse - new).nan_to_num(0.0), torch.exp(l_ - new).nan_to_num(0.0)
    out.mul_(keep.unsqueeze(-1)).add_(o * add.unsqueeze(-1))
    lse.copy_(new)


def _acc(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _block_fwd(q, k, v, scale, causal, mask):
    """(out, lse) of q's attention over one block of keys: the fused op, or
    with a document mask [b, 1, sq, sk] the same in torch (an empty row: out
    0, lse -inf)."""
    if mask is None:
        return torch.ops.mapp.attn_block_fwd(q, k, v, scale, causal)
    acc = _acc(q)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(probs, v.to(acc)), lse


def _block_bwd(dout, q, k, v, out, lse, scale, causal, mask):
    """(dq, dk, dv) of one block given the finished rows' out and lse."""
    if mask is None:
        return torch.ops.mapp.attn_block_bwd(dout, q, k, v, out, lse, scale, causal)
    acc = _acc(q)
    q, k, v, dout, out = (t.to(acc) for t in (q, k, v, dout, out))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    probs = torch.exp(scores.masked_fill(~mask, float("-inf")) - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = probs * (dp - (dout * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _block_mask(segments, rank, src, cp, s_local, qs, ks):
    """The document mask of rank's queries `qs` against rank src's keys `ks`
    (positions in the whole sequence from the zigzag layout), or None."""
    if segments is None:
        return None
    whole = torch.arange(s_local * cp, device=segments.device)
    qg = zigzag_split(whole, cp, rank, 0)[qs]
    kg = zigzag_split(whole, cp, src, 0)[ks]
    return _packed.attention_mask(segments, qg, kg)


def _wait(reqs, peer: int) -> None:
    """Waits for a ring exchange: traced as `cp_ring_wait` (what the step's
    compute did not hide)."""
    with _trace.scope("cp_ring_wait", "p2p", lane=0, peer=peer):
        for r in reqs:
            r.wait()


def _exchange(tensors, group, send_to, recv_from):
    """Posts the sends of `tensors` to `send_to` and receives of same-shaped
    buffers from `recv_from`; returns (buffers, requests)."""
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = []
    for t in tensors:
        ops.append(dist.P2POp(dist.isend, t.contiguous(), send_to, group))
    for b in bufs:
        ops.append(dist.P2POp(dist.irecv, b, recv_from, group))
    return bufs, dist.batch_isend_irecv(ops)


def _step_blocks(step: int, rank: int, cp: int, s_local: int):
    """(query slice, key slice, causal) pieces of ring step `step`'s work for
    this rank's zigzag queries against the visiting rank's zigzag keys."""
    half = s_local // 2
    src = (rank - step) % cp
    whole = slice(0, s_local)
    if step == 0:  # own block: causal in both halves, second queries see first keys
        return [(slice(0, half), slice(0, half), True), (slice(half, s_local), slice(0, half), False),
                (slice(half, s_local), slice(half, s_local), True)]
    if src < rank:  # an earlier rank's keys: all queries against its first chunk
        return [(whole, slice(0, half), False)]
    return [(slice(half, s_local), whole, False)]  # a later rank: second half of the queries


def _ring(group):
    """(size, rank, next global rank, previous global rank) of the ring."""
    cp, rank = group.size(), group.rank()
    ranks = dist.get_process_group_ranks(group)
    return cp, rank, ranks[(rank + 1) % cp], ranks[(rank - 1) % cp]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, segments):
        cp, rank, nxt, prv = _ring(group)
        s = q.shape[-2]
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32 if
                          q.dtype != torch.float64 else q.dtype, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=out.dtype, device=q.device)
        kv = (k, v)
        for step in range(cp):
            reqs = None
            if step + 1 < cp:  # the next block travels while this one is computed
                nxt_kv, reqs = _exchange(kv, group, nxt, prv)
            with _trace.scope("cp_ring_step", "compute", lane=0):
                for qs, ks, causal in _step_blocks(step, rank, cp, s):
                    mask = _block_mask(segments, rank, (rank - step) % cp, cp, s, qs, ks)
                    o, l_ = _block_fwd(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], scale,
                                       causal, mask)
                    _merge(out[..., qs, :], lse[..., qs], o.to(out.dtype), l_.to(out.dtype))
            if reqs is not None:
                _wait(reqs, prv)
                kv = tuple(nxt_kv)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.segments = group, scale, segments
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, segments = ctx.group, ctx.scale, ctx.segments
        cp, rank, nxt, prv = _ring(group)
        s = q.shape[-2]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=lse.dtype)
        kv = (k, v)
        incoming = dreqs = None  # the visiting block's dK/dV so far, on its way here
        for step in range(cp):
            reqs = None
            if step + 1 < cp:
                nxt_kv, reqs = _exchange(kv, group, nxt, prv)
            # This step's contribution to the visiting block's dK/dV goes into
            # a fresh accumulator while the sums of the ranks before us arrive.
            dkv = (torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype))
            with _trace.scope("cp_ring_step_backward", "compute", lane=0):
                for qs, ks, causal in _step_blocks(step, rank, cp, s):
                    mask = _block_mask(segments, rank, (rank - step) % cp, cp, s, qs, ks)
                    a, b, c = _block_bwd(
                        dout[..., qs, :], q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                        out[..., qs, :], lse[..., qs], scale, causal, mask)
                    dq[..., qs, :] += a
                    dkv[0][..., ks, :] += b
                    dkv[1][..., ks, :] += c
            if dreqs is not None:
                _wait(dreqs, prv)
                dkv[0].add_(incoming[0])
                dkv[1].add_(incoming[1])
            # The accumulator follows its block round the ring (after the last
            # step, home to its owner), hidden behind the next step's blocks.
            incoming, dreqs = _exchange(dkv, group, nxt, prv)
            if reqs is not None:
                _wait(reqs, prv)
                kv = tuple(nxt_kv)
        _wait(dreqs, prv)  # our own block's dK/dV, summed over every rank
        return dq.to(q.dtype), incoming[0].to(k.dtype), incoming[1].to(v.dtype), None, None, None


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def ring_attention(q, k, v, group, scale: float | None = None,
                   segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries over the whole sequence
    (q, k [b, heads, s_local, d], v [b, heads, s_local, d_v]); `group` is the
    context-parallel group; `scale` of the scores (default 1/sqrt(d));
    `segment_ids` [b, whole sequence]: each token's document, attention
    staying within it (packed_sequence)."""
    if group is None or group.size() == 1:
        if segment_ids is not None:
            return _local_documents(q, k, v, _scale(q, scale), segment_ids)
        return _LocalCausal.apply(q, k, v, _scale(q, scale))
    check_sequence(q.shape[-2] * group.size(), group.size())
    if segment_ids is not None:
        segment_ids = segment_ids.to(q.device)
    return _RingAttention.apply(q, k, v, group, _scale(q, scale), segment_ids)


def _local_documents(q, k, v, scale, segment_ids):
    """Causal attention within documents over a whole sequence (sequence order)."""
    idx = torch.arange(q.shape[-2], device=q.device)
    mask = _packed.attention_mask(segment_ids.to(q.device), idx, idx)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _LocalCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = torch.ops.mapp.attn_block_fwd(q, k, v, scale, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*torch.ops.mapp.attn_block_bwd(dout.contiguous(), q, k, v, out, lse, ctx.scale,
                                               True), None)


class _AllToAll(torch.autograd.Function):
    """[b, H, s/cp, d] sequence shards <-> [b, H/cp, s, d] head shards (the
    sequence in zigzag chunk order, rank-major)."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _a2a(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group, not ctx.to_heads), None, None


def _a2a(x, group, to_heads):
    cp = group.size()
    if to_heads:  # split heads, gather sequence: [cp, b, H/cp, s_local, d]
        send = torch.stack(x.chunk(cp, 1)).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return torch.cat(recv.unbind(0), dim=2)  # [b, H/cp, s, d], rank-major sequence
    send = torch.stack(x.chunk(cp, 2)).contiguous()  # sequence pieces back to their ranks
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=1)  # [b, H, s_local, d]


def _natural_order(cp: int) -> list:
    """Index of each zigzag chunk (rank-major: r's first, r's second) in the sequence."""
    order = []
    for r in range(cp):
        order += [r, 2 * cp - 1 - r]
    return order


def ulysses_attention(q, k, v, group, scale: float | None = None,
                      segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention by two all-to-alls (heads divisible by cp);
    `segment_ids` as ring_attention's."""
    if group is None or group.size() == 1:
        if segment_ids is not None:
            return _local_documents(q, k, v, _scale(q, scale), segment_ids)
        return _LocalCausal.apply(q, k, v, _scale(q, scale))
    cp = group.size()
    if q.shape[1] % cp:
        raise ValueError(f"--cp-comm-type a2a needs the attention heads on this rank "
                         f"({q.shape[1]}) divisible by --context-parallel-size {cp}; use "
                         "--cp-comm-type p2p or a divisible head count")
    check_sequence(q.shape[-2] * cp, cp)
    qh, kh, vh = (_AllToAll.apply(t, group, True) for t in (q, k, v))
    # Rank-major zigzag chunks -> sequence order, attention, and back.
    order = _natural_order(cp)
    inv = sorted(range(2 * cp), key=lambda i: order[i])

    def reorder(t, idx):
        chunks = t.chunk(2 * cp, 2)
        return torch.cat([chunks[i] for i in idx], 2)

    whole = [reorder(t, inv) for t in (qh, kh, vh)]
    if segment_ids is not None:
        out = _local_documents(*whole, _scale(q, scale), segment_ids)
    else:
        out = _LocalCausal.apply(*whole, _scale(q, scale))
    return _AllToAll.apply(reorder(out, order), group, False)
