"""YaRN rope scaling (rope_type "yarn"): frequencies blended between the original ones (fast rotations,
kept) and ones slowed by `factor` (slow rotations, interpolated) over a linear ramp between the dimensions
that rotate `beta_fast` and `beta_slow` times in the original context, and cos/sin scaled by an attention
factor. The same arithmetic as transformers' `_compute_yarn_parameters`, in the same float32 steps, so
the angles agree bit for bit. DeepSeek's `mscale` / `mscale_all_dim` pair sets that factor too, and
`mscale_all_dim` scales its latent attention's softmax (config.py `LatentAttentionSpec`)."""

from __future__ import annotations

import math

import torch

from tandem.engine.config import RopeConfig


def yarn_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: the config's `attention_factor`, else
    mscale(mscale) / mscale(mscale_all_dim) where both are set (DeepSeek), else mscale(1)
    (`RopeConfig.yarn_mscale`)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return rope.yarn_mscale(rope.mscale) / rope.yarn_mscale(rope.mscale_all_dim)
    return rope.yarn_mscale()


def _correction_dim(rotations: float, dim: int, base: float, max_position: int) -> float:
    """The dimension whose wavelength fits `rotations` times into `max_position` tokens."""
    return (dim * math.log(max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """float32 [dim / 2]."""
    base, factor = rope.theta, rope.factor
    low = _correction_dim(rope.beta_fast, dim, base, rope.original_max_position)
    high = _correction_dim(rope.beta_slow, dim, base, rope.original_max_position)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as upstream: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 where the original frequency is kept
    return interpolation * (1 - keep) + extrapolation * keep
