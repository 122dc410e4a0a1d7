"""RMS norms: the Llama form (w * x_hat) and the Gemma form ((1 + w) * x_hat, computed in float32).

`add` is the residual step every decoder layer takes: residual + delta, then the norm of the sum. On
CUDA with `FusedKernels` it is one kernel working in place; the torch form is the reference and what
the CPU runs (out of place, with the rounding HF transformers has).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.layers.source import TensorSource, check_shape


class RMSNorm(nn.Module):
    gemma = False

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        dtype: torch.dtype,
        device: torch.device,
        kernels: FusedKernels | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), False)
        self.kernels = kernels

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        check_shape(source, tuple(self.weight.shape), "an RMS norm")
        self.weight.data.copy_(source.read())

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normed(x).to(x.dtype)

    def forward(self, x: torch.Tensor, plan: KernelPlan = EAGER) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, self.weight, self.eps, gemma=self.gemma, plan=plan)
        return self._reference(x)

    def add(
        self, delta: torch.Tensor, residual: torch.Tensor, plan: KernelPlan = EAGER
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta). The fused kernel overwrites both inputs."""
        if self.kernels is not None:
            return self.kernels.add_rmsnorm(
                delta, residual, self.weight, self.eps, gemma=self.gemma, plan=plan
            )
        residual = residual + delta
        return self._reference(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma stores w - 1: the scale is (1 + w), applied before casting back, as upstream does."""

    gemma = True

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normed(x) * (1.0 + self.weight.float())).to(x.dtype)
