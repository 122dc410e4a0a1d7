"""flashinfer paged attention for the GPU: extend/prefill over a cached prefix, decode, decode graphs.

Planning happens once per batch and KV group, outside any graph, from the host copies of the batch
(lengths, kv_start, page table): page lists and append coordinates are built on the host and sent in
one copy (paged_layout.py); `forward` only stores K/V and runs the planned wrapper, so it works inside
a full decode graph and between piecewise prefill graphs alike.

Never import this module on CPU: the backend registry imports it on first use only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flashinfer
import numpy as np
import torch

from tandem.engine.attention.base import FusedDecode, LayerSpec
from tandem.engine.attention.flashinfer_buffers import AppendTargets, GraphBuffers
from tandem.engine.attention.kernel_params import GroupKernel, group_kernels
from tandem.engine.attention.paged_layout import (
    PagedLayout,
    append_coordinates,
    decode_graph_meta,
    page_indices,
    paged_layout,
)
from tandem.engine.attention.sinks import apply_sinks
from tandem.engine.batch import ForwardBatch
from tandem.engine.kv_pool import KVGroupSpec, KVPool


class FlashInferBackend:
    """Per KV group: one prefill wrapper (causal, paged, cached prefix), one decode wrapper, and one
    graph-mode decode wrapper per captured batch size.

    New K/V go in with flashinfer's `append_paged_kv_cache`, one kernel for K and V per layer (two
    torch index_puts cost three times as long at small batch), addressed through the same page lists
    as attention; or, where the model's rope kernel stores them in the same launch (`new_kv_slots`,
    `forward(stored=True)`), not at all here.

    Attention sinks (gpt-oss) are an epilogue: the wrapper's run also returns each query row's
    log-sum-exp over the keys (base 2, flashinfer's convention), and the output is rescaled by
    sigmoid(lse - sink) (attention/sinks.py). The same in prefill, decode, decode graphs (captured with
    the run) and between piecewise graphs (the run is eager there). The one-launch Triton decode has no
    sinks, so it never serves a group with them.

    Invariants: pages below a row's kv_start are never listed (evicted pages are stale); padding rows
    of a decode graph list only the pool's dummy page and store K/V only there; a plan never
    overwrites flashinfer's pinned staging buffer before the previous plan's copy has run (see
    `_wait_previous_plan`).
    """

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
        prefill_backend: str = "fa2",
        decode_backend: str = "fa2",
        decode_tensor_cores: bool = True,
        **_options: Any,
    ) -> None:
        self.groups = groups
        self.page_size = page_size
        self.device = device
        self.dtype = dtype
        # The pool's element type: the model dtype, or FP8 (flashinfer reads it with per-layer scales; the
        # Triton store and one-launch decode write and read 16-bit caches only, so FP8 turns them off).
        self.kv_dtype = kv_dtype or dtype
        self.fp8_kv = self.kv_dtype == torch.float8_e4m3fn
        self.kernels: dict[int, GroupKernel] = group_kernels(groups, layers)
        # Explicit kernel families rather than flashinfer's "auto", which may route to cuDNN, XQA or
        # fa3 depending on the GPU and the plan: fa2 for both keeps one kernel choice everywhere, and
        # tensor-core decode runs the fa2 prefill kernel, the same JIT module as fa2 prefill, so each
        # (head_dim, window, softcap) variant compiles once (a slow JIT build) rather than twice.
        # Tensor-core decode is also the faster one for grouped-query heads.
        self.decode_backend = decode_backend
        self.decode_tensor_cores = decode_tensor_cores
        # One float workspace for every wrapper: they all run on one stream, one kernel at a time.
        self.workspace = torch.zeros(workspace_mb << 20, dtype=torch.uint8, device=device)
        self.prefill = {
            g.group_id: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=prefill_backend
            )
            for g in groups
        }
        self.decode = {
            g.group_id: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=decode_tensor_cores, backend=decode_backend
            )
            for g in groups
        }
        self._graph: dict[int, GraphBuffers] = {}
        self._active: dict[int, Any] = {}
        self._append: dict[int, AppendTargets] = {}
        self._graph_targets: dict[tuple[int, int], AppendTargets] = {}  # per (group, graph size), built once
        # The one-launch decode (triton_decode.py) of the graph sizes whose plans take it, in the KV groups
        # it serves; `_fused` holds the planned batch's buffers per such group, or None.
        # Per served group and graph size, built once: the graphs' buffers never move.
        self._fused_by_size: dict[int, dict[int, FusedDecode]] = {}
        self._fused: dict[int, FusedDecode | None] = {}
        # (group, graph size) pairs whose captured graph runs the group's flashinfer decode wrapper: a
        # layer called `forward` while that size's graph was warmed up or captured. Where the one-launch
        # decode serves every layer of a group, nothing in the graph reads the wrapper's plan, so the
        # plan (flashinfer's host-side scheduling and its copies) is skipped for it.
        self._wrapper_graphs: set[tuple[int, int]] = set()
        # A graph-size plan skipped for a group, kept so a layer that does call the wrapper eagerly (never
        # a replay: only warm-ups, captures and tests run layers after a graph plan) plans it first.
        self._skipped: dict[int, Callable[[], None]] = {}
        self._graph_bs: int | None = None  # the graph size planned last; None after an eager plan
        self._planned = torch.cuda.Event()
        self._has_planned = False

    # ---- planning ------------------------------------------------------------------------------
    def _wait_previous_plan(self) -> None:
        """flashinfer's plan writes its schedule into a pinned host buffer and copies it to the GPU
        asynchronously. With overlap, the CPU may plan batch N+1 before the GPU has run batch N's
        copy, so wait for that copy first; it runs as soon as batch N-1 finishes, which the overlap
        loop has already waited for, so this costs next to nothing."""
        if self._has_planned:
            self._planned.synchronize()

    def _record_plan(self) -> None:
        self._planned.record()
        self._has_planned = True

    def plan(self, batch: ForwardBatch) -> None:
        self._wait_previous_plan()
        self._graph_bs = None
        self._skipped.clear()
        qo_indptr = None if batch.is_decode else _indptr(batch.extend_lens_cpu).pin_memory()
        for group in self.groups:
            gid = group.group_id
            paging = batch.groups[gid]
            layout = paged_layout(batch.seq_lens_cpu, paging.kv_start_cpu, self.page_size)
            indices = page_indices(paging.page_table_cpu, paging.kv_start_cpu, layout, self.page_size)
            rows, positions = append_coordinates(layout.kv_lens, batch.extend_lens_cpu)
            host, dev = self._send(
                [layout.indptr, layout.last_page_len, layout.kv_lens, indices, rows, positions]
            )
            pinned = PagedLayout(host[0], host[1], host[2])
            if qo_indptr is None:
                wrapper = self.decode[gid]
                self._plan_decode(wrapper, gid, pinned.indptr, pinned.last_page_len, dev[3])
            else:
                wrapper = self.prefill[gid]
                self._plan_prefill(wrapper, gid, qo_indptr, pinned, dev[3])
            self._active[gid] = wrapper
            self._append[gid] = AppendTargets(dev[4], dev[5], dev[3], dev[0], dev[1], paging.out_cache_loc)
            self._fused[gid] = None
        self._record_plan()

    def _send(self, parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host int32 arrays -> (pinned host views, device views), through one pinned buffer and one
        asynchronous copy: the planners read the host side, the kernels the device side.

        Page indices must go to the planners from the device: in graph mode flashinfer copies host
        indices into its buffer synchronously, which would wait for the batch still running."""
        host = torch.cat(parts).pin_memory()
        sizes = [p.shape[0] for p in parts]
        return list(host.split(sizes)), list(host.to(self.device, non_blocking=True).split(sizes))

    def _plan_prefill(
        self, wrapper: Any, gid: int, qo_indptr: torch.Tensor, layout: PagedLayout, indices: torch.Tensor
    ) -> None:
        k = self.kernels[gid]
        wrapper.plan(
            qo_indptr,
            layout.indptr,
            indices,
            layout.last_page_len,
            k.num_heads,
            k.num_kv_heads,
            k.head_dim,
            self.page_size,
            causal=True,
            sm_scale=k.scale,
            window_left=k.window_left,
            logits_soft_cap=k.softcap,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            non_blocking=True,
        )

    def _plan_decode(
        self, wrapper: Any, gid: int, indptr: torch.Tensor, last_page_len: torch.Tensor, indices: torch.Tensor
    ) -> None:
        k = self.kernels[gid]
        wrapper.plan(
            indptr,
            indices,
            last_page_len,
            k.num_heads,
            k.num_kv_heads,
            k.head_dim,
            self.page_size,
            window_left=k.window_left,
            logits_soft_cap=k.softcap,
            sm_scale=k.scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            non_blocking=True,
        )

    # ---- decode graphs ---------------------------------------------------------------------------
    def init_decode_graphs(
        self, batch_sizes: list[int], max_pages_per_row: int, fused_sizes: list[int]
    ) -> None:
        max_bs = max(batch_sizes)
        # Every real row lists at most max_pages_per_row pages; each padding row lists one.
        capacity = max_bs * (max_pages_per_row + 1)
        for group in self.groups:
            dummy = group.num_pages  # KVPool's dummy page
            buffers = GraphBuffers.allocate(max_bs, capacity, dummy, self.device, wrappers={})
            self._graph[group.group_id] = buffers
            buffers.wrappers.update(
                {
                    bs: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                        self.workspace,
                        "NHD",
                        use_cuda_graph=True,
                        use_tensor_cores=self.decode_tensor_cores,
                        backend=self.decode_backend,
                        paged_kv_indptr_buffer=buffers.indptr[: bs + 1],
                        paged_kv_indices_buffer=buffers.indices,
                        paged_kv_last_page_len_buffer=buffers.last_page_len[:bs],
                    )
                    for bs in batch_sizes
                }
            )
        self._init_fused_decode(fused_sizes)

    def _init_fused_decode(self, sizes: list[int]) -> None:
        """The one-launch decode's buffers and launch configuration (equal shares of each row) for each
        KV group it serves (full attention, no soft-cap, no sinks, a power-of-two head_dim) at these
        graph sizes."""
        served = {gid: k for gid, k in self.kernels.items() if k.one_launch}
        if not sizes or not served:
            return
        # Only where the plans chose it, which they do only where Triton imports (EngineConfig.triton).
        from tandem.engine.attention.triton_decode import DecodeScratch, launch_config

        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        for gid, k in served.items():
            configs = {bs: launch_config(bs, k.num_kv_heads, sms) for bs in sizes}
            partials = [bs * splits for bs, (splits, _) in configs.items()]
            scratch = DecodeScratch.allocate(
                max_bs=max(sizes),
                max_row_splits=max(partials),
                num_heads=k.num_heads,
                num_kv_heads=k.num_kv_heads,
                head_dim=k.head_dim,
                device=self.device,
            )
            bufs = self._graph[gid]
            fused = {}
            for bs, (splits, block_n) in configs.items():
                fused[bs] = FusedDecode(
                    pages=(bufs.indptr[: bs + 1], bufs.indices),
                    old_lens=bufs.coords[0, :bs],  # the new token's index in its row's listed KV
                    slots=bufs.coords[1, :bs],
                    scratch=scratch,
                    page_size=self.page_size,
                    splits=splits,
                    block_n=block_n,
                )
            self._fused_by_size[gid] = fused

    def plan_decode_graph(self, batch: ForwardBatch | None, graph_bs: int) -> None:
        """Plan a decode graph's batch; `batch` None plans the all-padding batch its capture runs."""
        self._wait_previous_plan()
        self._graph_bs = graph_bs
        for group in self.groups:
            gid = group.group_id
            bufs = self._graph[gid]
            kv_start = None  # full attention never evicts: every row's pages from its first
            if batch is None:
                seq_lens, table = np.zeros(0, dtype=np.int32), np.zeros((0, 1), dtype=np.int32)
            else:
                paging = batch.groups[gid]
                seq_lens, table = batch.seq_lens_cpu.numpy(), paging.page_table_cpu.numpy()
                if group.window is not None:
                    kv_start = paging.kv_start_cpu.numpy()
            # Written straight into the staging buffer (padding rows list the dummy page alone, one
            # token, so they store K/V only there), then sent in one copy.
            meta = decode_graph_meta(
                seq_lens, kv_start, table, graph_bs, group.num_pages, self.page_size, bufs.staged
            )
            listed = meta.indices.shape[0]
            bufs.send(listed)
            wrapper = bufs.wrappers[graph_bs]
            plan = functools.partial(self._plan_graph_wrapper, wrapper, gid, bufs, graph_bs, listed)
            self._skipped.pop(gid, None)
            if batch is None or (gid, graph_bs) in self._wrapper_graphs:
                plan()
            else:  # only the one launch reads the page lists: they are in place without a plan
                self._skipped[gid] = plan
            self._active[gid] = wrapper
            targets = self._graph_targets.get((gid, graph_bs))
            if targets is None:
                targets = self._graph_targets[(gid, graph_bs)] = bufs.append_targets(graph_bs)
            self._append[gid] = targets
            self._fused[gid] = self._fused_by_size.get(gid, {}).get(graph_bs)
        self._record_plan()

    def _plan_graph_wrapper(
        self, wrapper: Any, gid: int, bufs: GraphBuffers, graph_bs: int, listed: int
    ) -> None:
        """flashinfer's plan of a graph wrapper, from the staged host values. It copies indptr and the
        last-page lengths into the graph's buffers (again), and the indices from its own buffer, which
        torch skips as a copy onto itself."""
        host = bufs.staging
        at_last = bufs.last_at
        indices = bufs.indices[:listed]
        self._plan_decode(wrapper, gid, host[: graph_bs + 1], host[at_last : at_last + graph_bs], indices)

    def fused_decode(self, group_id: int) -> FusedDecode | None:
        return self._fused.get(group_id)

    def new_kv_slots(self, group_id: int) -> torch.Tensor | None:
        return None if self.fp8_kv else self._append[group_id].slots

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
        gid = pool.layer_group[layer.layer_id]
        a = self._append[gid]
        if not stored and self.fp8_kv:
            # Scaled to FP8 and stored by slot, through the pool (the same slots the Triton store takes).
            pool.store(layer.layer_id, a.slots.long(), k, v)
        elif not stored:
            flashinfer.append_paged_kv_cache(
                k,
                v,
                a.rows,
                a.positions,
                pool.paged_view(layer.layer_id),
                a.indices,
                a.indptr,
                a.last_page_len,
            )
        heads = None if out is None else out.view(-1, layer.num_heads, layer.head_dim)
        if self._graph_bs is not None:  # a decode graph's warm-up or capture: its graph runs the wrapper
            self._wrapper_graphs.add((gid, self._graph_bs))
            skipped = self._skipped.pop(gid, None)
            if skipped is not None:
                skipped()
        wrapper, cache = self._active[gid], pool.paged_view(layer.layer_id)
        scales: dict[str, Any] = {}
        if self.fp8_kv:
            k_scale, v_scale = pool.scales[layer.layer_id]
            scales = {"k_scale": k_scale, "v_scale": v_scale}
        if sinks is None:
            result = wrapper.run(q.contiguous(), cache, out=heads, **scales)
        else:
            result, lse = wrapper.run(q.contiguous(), cache, out=heads, return_lse=True, **scales)
            apply_sinks(result, lse, sinks, base2=True)
        return result.view(-1, layer.num_heads * layer.head_dim)  # type: ignore[no-any-return]


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lengths, 0)
    return indptr
