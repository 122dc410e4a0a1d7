"""Reference attention on any device: gather each row's live pages and call SDPA.

Slower than flashinfer, but it runs on CPU (CI) and serves as the reference on GPU. It handles a
cached prefix (extend), per-layer sliding windows over evicted page tables, GQA, logit soft-capping,
attention sinks and latent attention (MLA: one latent K head whose prefix is V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import FusedDecode, LayerSpec
from tandem.engine.attention.sinks import softmax_with_sinks
from tandem.engine.batch import ForwardBatch
from tandem.engine.kv_pool import KVGroupSpec, KVPool


@dataclass(frozen=True)
class _RowPlan:
    q_start: int
    q_len: int
    slots: torch.Tensor  # flat KV slots of the row's live tokens, in position order
    mask: torch.Tensor | None  # [q_len, kv_len] True where visible; None when all visible


class TorchAttentionBackend:
    """Per-row gather + SDPA. `plan` builds slot lists and masks once per batch and KV group.

    Its shapes depend on host values, so it cannot run inside a decode graph; it does run between
    the captured pieces of a piecewise graph.
    """

    supports_decode_graphs = False

    def __init__(
        self, groups: list[KVGroupSpec], page_size: int, device: torch.device, **options: Any
    ) -> None:
        # `options` (layer specs, dtype, kernel choices) matter only to the kernel backends.
        self.groups = groups
        self.page_size = page_size
        self.device = device
        self._rows: dict[int, list[_RowPlan]] = {}
        self._out_loc: dict[int, torch.Tensor] = {}

    def plan(self, batch: ForwardBatch) -> None:
        seq_lens = batch.seq_lens_cpu.tolist()
        ext_lens = batch.extend_lens_cpu.tolist()
        self._rows = {}
        self._out_loc = {g.group_id: batch.groups[g.group_id].out_cache_loc for g in self.groups}
        for group in self.groups:
            paging = batch.groups[group.group_id]
            tables = paging.page_table_cpu
            starts = paging.kv_start_cpu.tolist()
            rows: list[_RowPlan] = []
            q_start = 0
            for b, (seq, ext) in enumerate(zip(seq_lens, ext_lens)):
                kv_start = int(starts[b])
                positions = torch.arange(kv_start, seq, dtype=torch.int64)
                pages = tables[b].to(torch.int64)[positions // self.page_size]
                slots = (pages * self.page_size + positions % self.page_size).to(self.device)
                rows.append(_RowPlan(q_start, ext, slots, self._mask(seq, ext, kv_start, group.window)))
                q_start += ext
            self._rows[group.group_id] = rows

    def _mask(self, seq: int, ext: int, kv_start: int, window: int | None) -> torch.Tensor | None:
        q_pos = torch.arange(seq - ext, seq).unsqueeze(1)
        k_pos = torch.arange(kv_start, seq).unsqueeze(0)
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        if bool(visible.all()):
            return None
        return visible.to(self.device)

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
        group_id = pool.layer_group[layer.layer_id]
        if not stored:
            pool.store(layer.layer_id, self._out_loc[group_id], k, v)
        if out is None:
            out = torch.empty(q.shape[0], layer.num_heads * layer.out_dim, dtype=q.dtype, device=q.device)
        heads = out.view(q.shape[0], layer.num_heads, layer.out_dim)
        for row in self._rows[group_id]:
            qb = q[row.q_start : row.q_start + row.q_len].transpose(0, 1)  # [H, E, D]
            kb, vb = pool.gather(layer.layer_id, row.slots, q.dtype)
            if layer.latent_v:  # latent attention: V is the latent, K's first features
                vb = kb[..., : layer.latent_v]
            kb, vb = kb.transpose(0, 1), vb.transpose(0, 1)  # [Hkv, L, D]
            if layer.num_heads != layer.num_kv_heads:
                repeat = layer.num_heads // layer.num_kv_heads
                kb = kb.repeat_interleave(repeat, dim=0)
                vb = vb.repeat_interleave(repeat, dim=0)
            if layer.softcap is None and sinks is None:
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=row.mask, scale=layer.scale)
            else:
                ob = _explicit(qb, kb, vb, row.mask, layer.scale, layer.softcap, sinks)
            heads[row.q_start : row.q_start + row.q_len] = ob.transpose(0, 1)
        return out

    def new_kv_slots(self, group_id: int) -> torch.Tensor | None:
        return None  # the reference stores K/V itself, with index_put

    def fused_decode(self, group_id: int) -> FusedDecode | None:
        return None  # no decode graphs here, so no one-launch decode

    def init_decode_graphs(
        self, batch_sizes: list[int], max_pages_per_row: int, fused_sizes: list[int]
    ) -> None:
        raise NotImplementedError("the torch attention backend cannot run inside decode CUDA graphs")

    def plan_decode_graph(self, batch: ForwardBatch | None, graph_bs: int) -> None:
        raise NotImplementedError("the torch attention backend cannot run inside decode CUDA graphs")


def _explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention written out, for soft-capping and sinks (which SDPA has no argument for)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        probs = softmax_with_sinks(scores, sinks).to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
