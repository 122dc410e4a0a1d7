"""A low-rank delta that a GEMM adds to its outputs in its own epilogue: LoRA's expand (engine/lora/)
folded into the Triton GEMV of a one-row decode graph, so the layer's delta costs one launch, not two.

Plain tensors only, so engine/layers/ needs nothing of engine/lora/: the LoRA side shrinks the input
first and hands over its partial sums, the GEMV (triton_gemv.py) adds B times their sum to each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemvDelta:
    """out[t, n] += b[slot_t, n] . sum_s partial[s, t, j R : (j + 1) R] for slice j holding column n, on
    the rows whose slot is not negative."""

    partial: torch.Tensor  # [splits, T, slices x R] float32: the shrink's partial sums of x A^T
    b: torch.Tensor  # [slots, N, R], the scale folded in
    token_slots: torch.Tensor  # [>= T] int32, -1 for a row without a delta
    slices: torch.Tensor  # int32 (offset, size) of each slice in the output, in order
    rank: int

    @property
    def pieces(self) -> int:
        return int(self.slices.numel()) // 2
