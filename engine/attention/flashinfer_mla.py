"""flashinfer's MLA kernels for latent attention (DeepSeek-V2/V3): the flashinfer backend's option for
models whose layers are latent (`LayerSpec.latent_v`), chosen by `flashinfer_backend` from the layers.

The pool holds one latent per token and layer, kv_c then k_pe ([slots, 1, L + R]); flashinfer's
`BatchMLAPagedAttentionWrapper` reads the two parts as strided views of it (no copy) and attends in the
absorbed form the model hands over (q = q_nope W_UK, then q_pe), for prefill, chunked prefill and
decode alike (causal, the queries at the end of each row's KV). Decode graphs get one graph-mode
wrapper per captured batch size, over fixed buffers: the same page lists the paged backend's decode
graphs use (GraphBuffers, decode_graph_meta), with each row's KV length from their coordinates.

New latents are stored by flat slot through the pool (one index_put per layer, graph-capturable).
Never import this module on CPU: the backend registry imports it on first use only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import flashinfer
import torch

from tandem.engine.attention.base import FusedDecode, LayerSpec
from tandem.engine.attention.flashinfer_backend import FlashInferBackend
from tandem.engine.attention.flashinfer_buffers import GraphBuffers
from tandem.engine.attention.paged_layout import decode_graph_meta, page_indices, paged_layout
from tandem.engine.batch import ForwardBatch
from tandem.engine.kv_pool import KVGroupSpec, KVPool


def flashinfer_backend(
    groups: list[KVGroupSpec],
    page_size: int,
    device: torch.device,
    *,
    layers: Sequence[LayerSpec],
    **options: Any,
) -> Any:
    """The flashinfer backend for these layers: MLA's where they are latent, else the paged one."""
    if any(s.latent_v for s in layers):
        return FlashInferMLABackend(groups, page_size, device, layers=layers, **options)
    return FlashInferBackend(groups, page_size, device, layers=layers, **options)


@dataclass(frozen=True)
class MLAKernel:
    """What every latent layer shares, so one plan serves all of them."""

    num_heads: int
    kv_lora_rank: int  # kv_c's width, also the output's per head
    rope_dim: int  # k_pe's
    scale: float

    @classmethod
    def of(cls, specs: Sequence[LayerSpec]) -> MLAKernel:
        kernels = {cls(s.num_heads, s.latent_v, s.head_dim - s.latent_v, s.scale) for s in specs}
        if len(kernels) != 1 or not all(
            s.latent_v and s.num_kv_heads == 1 and s.window is None for s in specs
        ):
            raise ValueError(f"the flashinfer MLA backend needs latent layers of one shape, got {kernels}")
        return kernels.pop()


class FlashInferMLABackend:
    """One KV group (MLA models have no window), one eager wrapper, one graph wrapper per graph size."""

    supports_decode_graphs = True

    def __init__(
        self,
        groups: list[KVGroupSpec],
        page_size: int,
        device: torch.device,
        *,
        layers: Sequence[LayerSpec],
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        workspace_mb: int = 256,
        mla_backend: str = "auto",  # flashinfer's choice: fa3 on SM90, else fa2
        **_options: Any,
    ) -> None:
        if len(groups) != 1:
            raise ValueError(f"latent attention takes one KV group, got {len(groups)}")
        if kv_dtype is not None and kv_dtype != dtype:
            raise ValueError(f"the flashinfer MLA backend stores the latent in {dtype}, not {kv_dtype}")
        self.group = groups[0]
        self.page_size, self.device, self.dtype = page_size, device, dtype
        self.kernel = MLAKernel.of(layers)
        self.mla_backend = mla_backend
        self.workspace = torch.zeros(workspace_mb << 20, dtype=torch.uint8, device=device)
        self.eager = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=mla_backend)
        self._active: Any = self.eager
        self._slots = torch.zeros(0, dtype=torch.int64, device=device)
        self._graph: GraphBuffers | None = None
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_slots: dict[int, torch.Tensor] = {}
        self._planned = torch.cuda.Event()
        self._has_planned = False

    # ---- planning ------------------------------------------------------------------------------
    def _wait_previous_plan(self) -> None:
        """As the paged backend: the last plan's pinned staging copy has run before it is rewritten."""
        if self._has_planned:
            self._planned.synchronize()

    def _record_plan(self) -> None:
        self._planned.record()
        self._has_planned = True

    def plan(self, batch: ForwardBatch) -> None:
        self._wait_previous_plan()
        paging = batch.groups[self.group.group_id]
        layout = paged_layout(batch.seq_lens_cpu, paging.kv_start_cpu, self.page_size)
        indices = page_indices(paging.page_table_cpu, paging.kv_start_cpu, layout, self.page_size)
        qo_indptr = torch.zeros(batch.extend_lens_cpu.shape[0] + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(batch.extend_lens_cpu, 0)
        host = torch.cat([qo_indptr, layout.indptr, layout.kv_lens]).pin_memory()
        qo, kv_indptr, kv_lens = host.split(
            [qo_indptr.shape[0], layout.indptr.shape[0], layout.kv_lens.shape[0]]
        )
        self._plan(self.eager, qo, kv_indptr, indices.to(self.device, non_blocking=True), kv_lens)
        self._active = self.eager
        self._slots = paging.out_cache_loc
        self._record_plan()

    def _plan(
        self,
        wrapper: Any,
        qo: torch.Tensor,
        kv_indptr: torch.Tensor,
        indices: torch.Tensor,
        kv_lens: torch.Tensor,
    ) -> None:
        """Host indptrs and lengths (no sync), device page indices (graph-mode wrappers copy host ones
        synchronously, as the paged backend notes)."""
        k = self.kernel
        wrapper.plan(qo, kv_indptr, indices, kv_lens, k.num_heads, k.kv_lora_rank, k.rope_dim,
                     self.page_size, True, k.scale, self.dtype, self.dtype)  # fmt: skip

    # ---- decode graphs ---------------------------------------------------------------------------
    def init_decode_graphs(
        self, batch_sizes: list[int], max_pages_per_row: int, fused_sizes: list[int]
    ) -> None:
        max_bs = max(batch_sizes)
        bufs = GraphBuffers.allocate(
            max_bs, max_bs * (max_pages_per_row + 1), self.group.num_pages, self.device, wrappers={}
        )
        self._graph = bufs
        qo = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        kv_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        for bs in batch_sizes:
            self._graph_wrappers[bs] = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                self.workspace,
                use_cuda_graph=True,
                qo_indptr=qo[: bs + 1],
                kv_indptr=bufs.indptr[: bs + 1],
                kv_indices=bufs.indices,
                kv_len_arr=kv_lens[:bs],
                backend=self.mla_backend,
            )
            self._graph_slots[bs] = bufs.coords[1, :bs]

    def plan_decode_graph(self, batch: ForwardBatch | None, graph_bs: int) -> None:
        """A decode graph's batch padded to `graph_bs` rows (None: all padding, for its capture); the
        padding rows list the dummy page alone, one token, and store their latent there."""
        assert self._graph is not None, "init_decode_graphs first"
        self._wait_previous_plan()
        bufs = self._graph
        if batch is None:
            seq_lens, table = (
                torch.zeros(0, dtype=torch.int32).numpy(),
                torch.zeros(0, 1, dtype=torch.int32).numpy(),
            )
        else:
            seq_lens = batch.seq_lens_cpu.numpy()
            table = batch.groups[self.group.group_id].page_table_cpu.numpy()
        meta = decode_graph_meta(
            seq_lens, None, table, graph_bs, self.group.num_pages, self.page_size, bufs.staged
        )
        listed = meta.indices.shape[0]
        bufs.send(listed)
        host = bufs.staging
        # Each row's KV length: the new token's index in its listed KV, plus one.
        kv_lens = torch.from_numpy(bufs.staged.coords[0, :graph_bs] + 1)
        qo = torch.arange(graph_bs + 1, dtype=torch.int32)
        wrapper = self._graph_wrappers[graph_bs]
        self._plan(wrapper, qo, host[: graph_bs + 1], bufs.indices[:listed], kv_lens)
        self._active = wrapper
        self._slots = self._graph_slots[graph_bs]
        self._record_plan()

    def fused_decode(self, group_id: int) -> FusedDecode | None:
        return None  # the one-launch decode is for q/k/v heads

    def new_kv_slots(self, group_id: int) -> torch.Tensor | None:
        return None  # the latent is stored here

    # ---- running ---------------------------------------------------------------------------------
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
        """q [T, H, L + R] absorbed; k [T, 1, L + R] the new latents -> [T, H * L]. Latent layers have
        no sinks: the piecewise graphs pass every layer's (None here) by one signature."""
        if sinks is not None:
            raise ValueError("the flashinfer MLA backend has no attention sinks")
        latent = self.kernel.kv_lora_rank
        if not stored:
            pool.store(layer.layer_id, self._slots.long(), k, v)
        cache = pool.paged_view(layer.layer_id)[0][:, :, 0]  # [pages, page_size, L + R]
        heads = None if out is None else out.view(-1, layer.num_heads, latent)
        result = self._active.run(
            q[..., :latent], q[..., latent:], cache[..., :latent], cache[..., latent:], out=heads
        )
        return result.view(-1, layer.num_heads * latent)  # type: ignore[no-any-return]
