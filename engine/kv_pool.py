"""The paged KV pool of one rank: only this rank's KV heads, one pool per KV group.

Layers are split into KV groups by window: full-attention layers share one page space, and the
sliding-window layers of a hybrid model (Gemma 2/3) have their own, so the scheduler can free window
pages early without touching the full layers' pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.config import ModelConfig


@dataclass(frozen=True)
class KVGroupSpec:
    """One page space: which layers use it, their window (None for full attention), its size."""

    group_id: int
    layers: tuple[int, ...]
    window: int | None
    num_pages: int


def plan_groups(config: ModelConfig, num_pages: int, window_pages: int | None = None) -> list[KVGroupSpec]:
    """Split layers into a full group and a window group; a model of one kind gets one group."""
    full = tuple(i for i in range(config.num_layers) if config.window_of(i) is None)
    windowed = tuple(i for i in range(config.num_layers) if config.window_of(i) is not None)
    groups: list[KVGroupSpec] = []
    if full:
        groups.append(KVGroupSpec(len(groups), full, None, num_pages))
    if windowed:
        groups.append(KVGroupSpec(len(groups), windowed, config.sliding_window, window_pages or num_pages))
    return groups


class KVPool:
    """K and V caches per layer, addressed by flat slot = page * page_size + offset within its group.

    Each group holds one page more than the scheduler hands out: page `num_pages` (`dummy_page`) is
    owned by no request, so CUDA-graph padding rows can read and write it without touching live KV.

    A latent pool (DeepSeek's MLA: `v_head_dim` 0) holds one K "head" per token, the compressed latent
    and the rope key, which every query head reads; V is a prefix of it, so nothing is stored for V.

    An FP8 pool (`dtype` float8_e4m3fn) stores k / k_scale and v / v_scale per layer (`scales`, from the
    checkpoint; 1.0 where it has none), saturated to FP8's range; readers multiply the scale back.
    """

    def __init__(
        self,
        groups: list[KVGroupSpec],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        scales: dict[int, tuple[float, float]] | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        """`v_head_dim`: V's width where it differs from K's (0: a latent pool, no V)."""
        self.groups = groups
        self.dtype = dtype
        self.fp8 = dtype == torch.float8_e4m3fn
        self.scales: dict[int, tuple[float, float]] = {}
        self.page_size = page_size
        self.layer_group: dict[int, int] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for group in groups:
            slots = (group.num_pages + 1) * page_size
            for layer in group.layers:
                self.layer_group[layer] = group.group_id
                self.scales[layer] = (scales or {}).get(layer, (1.0, 1.0))
                self.k[layer] = torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                v_dim = head_dim if v_head_dim is None else v_head_dim
                self.v[layer] = torch.zeros(slots, num_kv_heads, v_dim, dtype=dtype, device=device)

    def dummy_page(self, group_id: int) -> int:
        return self.groups[group_id].num_pages

    def paged_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [pages, page_size, kv_heads, head_dim] (flashinfer's NHD layout)."""
        k, v = self.k[layer], self.v[layer]
        shape = (-1, self.page_size, k.shape[1], k.shape[2])
        return k.view(shape), v.view(shape)

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New K and V as the pool stores them: as they are, or scaled and saturated to FP8."""
        if not self.fp8:
            return k, v
        k_scale, v_scale = self.scales[layer]
        limit = torch.finfo(self.dtype).max
        return (
            (k.float() / k_scale).clamp(-limit, limit).to(self.dtype),
            (v.float() / v_scale).clamp(-limit, limit).to(self.dtype),
        )

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` in `dtype`, their scales multiplied back (the reference attention's read)."""
        k, v = self.k[layer][slots], self.v[layer][slots]
        if not self.fp8:
            return k, v
        k_scale, v_scale = self.scales[layer]
        return (k.float() * k_scale).to(dtype), (v.float() * v_scale).to(dtype)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = self.encode(layer, k, v)
        if self.fp8:  # FP8 bytes through a uint8 view: index_put takes every integer type
            self.k[layer].view(torch.uint8)[loc] = k.view(torch.uint8)
            self.v[layer].view(torch.uint8)[loc] = v.view(torch.uint8)
            return
        self.k[layer][loc] = k
        self.v[layer][loc] = v

    def bytes_per_page(self) -> int:
        """One page of one layer: K and V."""
        k, v = next(iter(self.k.values())), next(iter(self.v.values()))
        return (k[0].numel() + v[0].numel()) * k.element_size() * self.page_size

    def bytes_per_token(self) -> int:
        """What one token's K and V cost over all layers on this rank (`kv_bytes_per_token`)."""
        return sum((self.k[i][0].numel() + self.v[i][0].numel()) * self.k[i].element_size() for i in self.k)
