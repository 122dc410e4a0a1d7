"""The attention-backend interface: plan once per batch (outside any graph), then run per layer.

This matches flashinfer's plan/run model: `plan` turns the batch's page tables and lengths into
whatever metadata the kernels need; `forward` only reads that metadata, so it can run inside a CUDA
graph (decode) or eagerly between captured pieces (piecewise prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.engine.batch import ForwardBatch
from tandem.engine.kv_pool import KVPool

if TYPE_CHECKING:
    from tandem.engine.attention.triton_decode import DecodeScratch


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
    sinks: bool = False  # a learned sink logit per head joins the softmax (attention/sinks.py)
    # Latent attention (MLA, absorbed form): K is one head, the latent (kv_c, then k_pe), and V is its
    # first `latent_v` features, so the pool stores no V and each head's output is `latent_v` wide.
    # 0: plain K/V heads.
    latent_v: int = 0

    @property
    def out_dim(self) -> int:
        """Each head's output width: V's head size."""
        return self.latent_v or self.head_dim

    @property
    def stored_v_dim(self) -> int:
        """V's width in the KV pool (0 under latent attention: V is read from K)."""
        return 0 if self.latent_v else self.head_dim


@dataclass(frozen=True)
class FusedDecode:
    """What the one-launch small-batch decode (triton_decode.py) reads for one KV group of a planned decode
    graph: fixed-address buffers, rewritten by every plan, so a graph may capture the launch."""

    pages: tuple[torch.Tensor, torch.Tensor]  # (indptr [B + 1], indices): each row's listed pages
    old_lens: torch.Tensor  # [B]: each row's listed tokens before the new one
    slots: torch.Tensor  # [B]: the new token's flat pool slot
    scratch: DecodeScratch
    page_size: int
    splits: int
    block_n: int  # tokens per block of a program's walk over its share of the KV


class AttentionBackend(Protocol):
    # Whether `plan_decode_graph` works: full decode graphs need fixed-address metadata buffers.
    supports_decode_graphs: bool

    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata. Called once per batch, before the model runs."""

    def forward(
        self,
        layer: LayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: KVPool,
        out: torch.Tensor | None = None,
        stored: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v for the new tokens, then attend. q [T, H, D], k/v [T, Hkv, D] -> [T, H * D].

        `out` ([T, H * D]), when given, receives the result (a static buffer of a piecewise graph).
        `stored`: the caller already wrote k/v at `new_kv_slots`, so k and v are not read.
        `sinks` [H]: the layer's sink logits where its spec says `sinks`.
        """
        ...

    def new_kv_slots(self, group_id: int) -> torch.Tensor | None:
        """The flat pool slot of each new token of the planned batch in this KV group (device, [T]),
        for a q/k/v step that stores K/V itself in the same launch as its rope; None where the
        backend stores them. After `plan_decode_graph` these sit at fixed addresses, with padding
        rows at the dummy page, so a decode graph may capture them."""
        ...

    def fused_decode(self, group_id: int) -> FusedDecode | None:
        """Where the planned batch is a decode graph whose plan says `fused_decode` and this KV group's
        layers have no window or soft-cap: its buffers, for the layer's one launch. None otherwise."""
        ...

    def init_decode_graphs(
        self, batch_sizes: list[int], max_pages_per_row: int, fused_sizes: list[int]
    ) -> None:
        """Allocate fixed metadata buffers for decode graphs of these padded batch sizes; those in
        `fused_sizes` (their plans say `fused_decode`) also get the one-launch decode's buffers."""

    def plan_decode_graph(self, batch: ForwardBatch | None, graph_bs: int) -> None:
        """Plan a decode batch padded to `graph_bs` rows into the fixed buffers (None: all padding).

        Padding rows read and write only the pool's dummy page.
        """
