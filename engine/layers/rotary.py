"""Rotary position embeddings (rotate-half form, or DeepSeek's interleaved pairs), with Llama-3.1, linear
and YaRN frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.engine.config import RopeConfig, yarn_mscale
from tandem.engine.layers.fused import FusedKernels


def yarn_frequencies(rope: RopeConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF transformers computes it: (inverse frequencies, the factor that
    scales cos and sin). Frequencies that turn more than `beta_fast` times over the original context
    are kept, those under `beta_slow` turns are divided by `factor`, with a linear ramp between
    (its ends rounded to whole dimensions unless `truncate` is off). The cos/sin factor is
    `attention_factor` where given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) where
    both are set (DeepSeek), else mscale(factor)."""
    dim, base = rotary_dim, rope.theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    inv = interpolated * (1 - keep) + extrapolated * keep
    if rope.attention_factor is not None:
        factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)
    return inv, float(factor)


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    if rope.rope_type == "yarn":
        return yarn_frequencies(rope, rotary_dim)[0]
    inv = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """Computes cos/sin from positions on the fly: no table sized by the context length.

    With `FusedKernels` (CUDA) it rotates q and k with one kernel instead, reading a cos/sin table
    that every layer with the same rope shares.

    `interleaved` (DeepSeek's checkpoints): each rotated pair is (x[2i], x[2i + 1]) rather than
    (x[i], x[i + D/2]); the output lists the pairs' first halves, then their second halves, as HF's
    `apply_rotary_pos_emb_interleave` does (q and k alike, so their dot products are unchanged). It and
    YaRN's cos/sin factor take the torch path.
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        device: torch.device,
        kernels: FusedKernels | None = None,
        *,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.interleaved = interleaved
        self.cos_sin_factor = 1.0
        if rope.rope_type == "yarn":
            inv_freq, self.cos_sin_factor = yarn_frequencies(rope, head_dim)
        else:
            inv_freq = inverse_frequencies(rope, head_dim)
        inv_freq = inv_freq.to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if interleaved or self.cos_sin_factor != 1.0:
            kernels = None
        self.kernels = kernels
        # Not a buffer: it is shared, and no checkpoint or .to() should see one copy per layer.
        self.table = None if kernels is None else kernels.cos_sin_table(rope, inv_freq)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None and self.table is not None:
            return self.kernels.rope(positions, q, k, self.table)
        inv_freq = self.get_buffer("inv_freq")
        freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)
        if self.interleaved:
            # cos and sin rounded to the activation dtype before use, as HF's DeepSeek-V3 does.
            cos = (freqs.cos() * self.cos_sin_factor).to(q.dtype).unsqueeze(1)
            sin = (freqs.sin() * self.cos_sin_factor).to(q.dtype).unsqueeze(1)
            return _apply_interleaved(q, cos, sin), _apply_interleaved(k, cos, sin)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().unsqueeze(1)
        sin = emb.sin().unsqueeze(1)
        if self.cos_sin_factor != 1.0:
            cos, sin = cos * self.cos_sin_factor, sin * self.cos_sin_factor
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def _apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
