"""Rotary position embeddings (rotate-half form, or DeepSeek's interleaved pairs), with Llama-3.1, linear
and YaRN (layers/yarn.py) frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.engine.config import RopeConfig
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.layers.yarn import yarn_attention_factor, yarn_inverse_frequencies


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    if rope.rope_type == "yarn":
        return yarn_inverse_frequencies(rope, rotary_dim)
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


def cos_sin_scale(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return yarn_attention_factor(rope) if rope.rope_type == "yarn" else 1.0


class RotaryEmbedding(nn.Module):
    """Computes cos/sin from positions on the fly: no table sized by the context length.

    With `FusedKernels` (CUDA) it rotates q and k with one kernel instead, reading a cos/sin table
    that every layer with the same rope shares.

    `interleaved` (DeepSeek's checkpoints): each rotated pair is (x[2i], x[2i + 1]) rather than
    (x[i], x[i + D/2]); the output lists the pairs' first halves, then their second halves, as HF's
    `apply_rotary_pos_emb_interleave` does (q and k alike, so their dot products are unchanged). It
    takes the torch path (the fused kernel rotates halves).
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
        inv_freq = inverse_frequencies(rope, head_dim).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = cos_sin_scale(rope)
        if interleaved:
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
            cos = (freqs.cos() * self.scale).to(q.dtype).unsqueeze(1)
            sin = (freqs.sin() * self.scale).to(q.dtype).unsqueeze(1)
            return _apply_interleaved(q, cos, sin), _apply_interleaved(k, cos, sin)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def _apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
