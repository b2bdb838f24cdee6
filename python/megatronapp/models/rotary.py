"""Rotary position embeddings (RoPE), Megatron-LM's semantics.

``--position-embedding-type rope`` rotates the first ``rot = kv_channels x
--rotary-percent`` channels of every query and key head by angles
``position x inv_freq``, ``inv_freq[i] = base^(-2i / rot)`` (``--rotary-base``).
The default pairs channel ``i`` with ``i + rot/2`` (GPT-NeoX / Llama /
Hugging Face "rotate half"); ``--rotary-interleaved`` pairs ``2i`` with
``2i + 1`` (GPT-J / Meta's original Llama code). ``--use-rope-scaling``
stretches the low frequencies as Llama-3.1 does (factor, low/high frequency
factors 1 and 4, original context 8192). ``--position-embedding-type yarn``
(DeepSeek's long-context RoPE; Peng et al., YaRN, 2023) interpolates the
frequencies whose wavelength exceeds the original context by
``--yarn-rotary-scaling-factor``, keeps those that rotate more than
``--yarn-beta-fast`` times in it, ramps linearly in between, and scales
cos/sin by ``mscale(factor, --yarn-mscale) / mscale(factor,
--yarn-mscale-all-dim)`` with ``mscale(f, m) = 0.1 m ln f + 1``
(:func:`yarn_inv_freq`, :func:`yarn_mscale`).

Positions are a sequence's absolute positions; under context parallelism a
rank's tokens are its zigzag chunks, and their positions are those chunks'
(:func:`positions`), so RoPE composes with ring and all-to-all attention.
The angles are computed in float32 and cached per (positions, device).
"""

from __future__ import annotations

import math

import torch

from ..packed_sequence import current as current_packed

__all__ = ["RotaryEmbedding", "apply_rotary", "inv_freq", "positions", "yarn_inv_freq",
           "yarn_mscale"]


def inv_freq(rot_dim: int, base: float, *, scaling_factor: float | None = None,
             low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
             original_max_position: int = 8192) -> torch.Tensor:
    """The rot_dim / 2 inverse frequencies (float32); with ``scaling_factor``
    Llama-3.1's rescaling of the long wavelengths."""
    freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    if scaling_factor is None:
        return freq
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / scaling_factor, freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor ``0.1 mscale ln(factor) + 1`` (1 for
    factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(rot_dim: int, base: float, factor: float, original_max_position: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """YaRN's rot_dim / 2 inverse frequencies (float32): dimensions that turn
    more than `beta_fast` times over the original context keep their
    frequency, those that turn fewer than `beta_slow` times are divided by
    `factor`, and a linear ramp blends the ones between (bounds rounded
    outwards to whole dimensions)."""
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return rot_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(base))
    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rot_dim - 1)
    if high == low:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float()
                                   / rot_dim))
    keep = 1 - ramp  # 1: the original frequency (fast dimensions)
    return extrapolated / factor * ramp + extrapolated * keep


def positions(s: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The absolute positions of this rank's `s` tokens (its zigzag chunks of
    a sequence of s x cp_size under context parallelism)."""
    pos = torch.arange(s * cp_size, device=device)
    if cp_size > 1:
        from .context_parallel import zigzag_split

        pos = zigzag_split(pos, cp_size, cp_rank, 0)
    return pos


class RotaryEmbedding:
    """cos / sin tables [s, rot] for a rank's positions (not a module: no
    parameters, nothing in checkpoints)."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, base: float = 10000.0, *,
                 interleaved: bool = False, scaling_factor: float | None = None,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                 original_max_position: int = 8192, yarn: dict | None = None):
        """`yarn`: {factor, original_max_position, beta_fast, beta_slow,
        mscale, mscale_all_dim} for YaRN's frequencies and cos/sin factor."""
        rot = int(kv_channels * rotary_percent)
        rot -= rot % 2
        if rot < 2:
            raise ValueError(f"--rotary-percent {rotary_percent} of kv_channels {kv_channels} "
                             "leaves no channel pair to rotate")
        self.rot_dim, self.interleaved = rot, interleaved
        self.attention_factor = 1.0  # cos and sin are multiplied by it
        if yarn is not None:
            self.inv_freq = yarn_inv_freq(rot, base, yarn["factor"], yarn["original_max_position"],
                                          yarn["beta_fast"], yarn["beta_slow"])
            self.attention_factor = (yarn_mscale(yarn["factor"], yarn["mscale"])
                                     / yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])
                                     if yarn["mscale"] and yarn["mscale_all_dim"]
                                     else yarn_mscale(yarn["factor"]))
        else:
            self.inv_freq = inv_freq(rot, base, scaling_factor=scaling_factor,
                                     low_freq_factor=low_freq_factor,
                                     high_freq_factor=high_freq_factor,
                                     original_max_position=original_max_position)
        self._cache: dict = {}

    def tables(self, s: int, cp_size: int, cp_rank: int, device, dtype):
        """cos, sin [s, rot] of this rank's positions; inside a packed
        microbatch's forward with reset positions (packed_sequence), [b, 1, s,
        rot] of each token's position in its document."""
        packed = current_packed()
        if packed is not None and packed.position_ids is not None:
            return self._of(packed.position_ids.float().unsqueeze(1), device, dtype)
        key = (s, cp_size, cp_rank, str(device), dtype)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._of(positions(s, cp_size, cp_rank).float(), device, dtype)
            if len(self._cache) > 16:
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def _of(self, pos: torch.Tensor, device, dtype):
        freqs = pos.to(self.inv_freq.device).unsqueeze(-1) * self.inv_freq  # [..., s, rot/2]
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        a = self.attention_factor
        return (emb.cos() * a).to(device, dtype), (emb.sin() * a).to(device, dtype)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotates the first cos.shape[-1] channels of `t` [..., s, d] (cos/sin [s, rot])."""
    rot = cos.shape[-1]
    x, rest = (t, None) if rot == t.shape[-1] else (t[..., :rot], t[..., rot:])
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        turned = torch.stack((-odd, even), dim=-1).flatten(-2)
    else:
        a, b = x.chunk(2, dim=-1)
        turned = torch.cat((-b, a), dim=-1)
    out = x * cos + turned * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)
