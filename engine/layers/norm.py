"""RMS norms: the Llama form (w * x_hat) and the Gemma form ((1 + w) * x_hat, computed in float32)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.layers.source import TensorSource, check_shape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), False)

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        check_shape(source, tuple(self.weight.shape), "an RMS norm")
        self.weight.data.copy_(source.read())

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normed(x).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma stores w - 1: the scale is (1 + w), applied before casting back, as upstream does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normed(x) * (1.0 + self.weight.float())).to(x.dtype)
