"""The attention-backend interface: plan once per batch (outside any graph), then run per layer.

This matches flashinfer's plan/run model: `plan` turns the batch's page tables and lengths into
whatever metadata the kernels need; `forward` only reads that metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.batch import ForwardBatch
from tandem.engine.kv_pool import KVPool


@dataclass(frozen=True)
class LayerSpec:
    """Static facts about one attention layer."""

    layer_id: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    scale: float
    window: int | None  # keys in (q - window, q] are visible; None for full attention
    softcap: float | None


class AttentionBackend(Protocol):
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata. Called once per batch, before the model runs."""

    def forward(
        self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        """Store k/v for the new tokens, then attend. q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        ...
