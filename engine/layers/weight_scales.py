"""How an FP8 weight is scaled back to real values, for the kernels that read FP8 bytes themselves (the
Triton GEMV of decode graphs) rather than a library GEMM that was handed its scales once."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightScales:
    """The scales of an FP8 weight [N, K]: w = w_fp8 * scale. `block` None: `values` is float32 [N], one
    scale per output channel; else `values` is float32 [ceil(N / block[0]), ceil(K / block[1])], one per
    block (edge blocks cover what is left), as block-scaled checkpoints store `weight_scale_inv`."""

    values: torch.Tensor
    block: tuple[int, int] | None = None

    def dequantize(self, weight: torch.Tensor) -> torch.Tensor:
        """The float32 weight these scales give `weight` (a reference, and the path for inputs no kernel
        takes)."""
        w = weight.float()
        if self.block is None:
            return w * self.values.reshape(-1, 1)
        rows, cols = w.shape
        b0, b1 = self.block
        return w * self.values.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
