"""Full CUDA graphs for decode: the model (embedding through the LM head) per padded batch size."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.batch import ForwardBatch
from tandem.engine.graph_buckets import decode_batch_sizes, padded_size
from tandem.engine.kernel_plan import KernelPlan, KernelPlanner
from tandem.engine.kv_pool import KVPool
from tandem.engine.lora.runtime import EngineLora
from tandem.engine.models.common import CausalLM
from tandem.engine.models.context import ForwardContext


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
    """Capture on `stream` into the shared memory `pool`.

    Unlike `torch.cuda.graph`, this skips the device synchronize, gc.collect and empty_cache that
    it runs per capture: over the ~1000 piecewise graphs of a 28-layer model they cost seconds. The
    callers synchronize once before capturing.
    """
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()


class DecodeGraphRunner:
    """One CUDA graph per padded decode batch size, captured largest first into one memory pool.

    The graphs read token ids and positions from static buffers and the attention backend's fixed
    metadata buffers, which `run` re-plans outside the graph before each replay. Padding rows read
    and write only the KV pool's dummy page. Every graph writes its logits into one buffer of the
    largest size's rows, so the LM head is part of the replay (no launch of its own on the host) and
    the graphs hold one vocab-wide output between them, not one each. Its rows are read (sampled) on
    the engine stream before the next replay overwrites them. Sampling runs after the graph.

    Each size's `KernelPlan` is resolved once, here, and captured with its graph. With LoRA on, every size
    is captured twice, with the layers' deltas and without, so a batch of base rows alone replays a graph
    that runs none of the LoRA kernels; the LoRA graphs read the rows' slots from the engine's fixed
    LoRA buffers, which the engine plans before each replay.
    """

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        pool: KVPool,
        *,
        max_bs: int,
        max_pages_per_row: int,
        device: torch.device,
        planner: KernelPlanner | None = None,
        lora: EngineLora | None = None,
    ) -> None:
        if not attention.supports_decode_graphs:
            raise ValueError("decode CUDA graphs need an attention backend with fixed metadata buffers")
        self.model = model
        self.attention = attention
        self.pool = pool
        self.device = device
        self.sizes = decode_batch_sizes(max_bs)
        planner = planner or KernelPlanner()
        self.plans: dict[int, KernelPlan] = {bs: planner.decode(bs) for bs in self.sizes}
        self.lora = lora
        self.variants = (False, True) if lora is not None else (False,)
        self.max_pages_per_row = max_pages_per_row
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        width = model.lm_head.padded_vocab
        self.logits = torch.empty(self.sizes[-1], width, dtype=model.logits_dtype, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, with LoRA deltas)
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        fused = [bs for bs, plan in self.plans.items() if plan.fused_decode]
        self.attention.init_decode_graphs(self.sizes, self.max_pages_per_row, fused)
        memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        torch.cuda.synchronize(self.device)
        if self.lora is not None:
            self.lora.use_graph_buffers()  # as planned before capture: no tiles, so no row is changed
        for bs in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory
            for lora in self.variants:
                self._capture_one(bs, lora, memory, stream, current)
        torch.cuda.synchronize(self.device)

    def _capture_one(
        self, bs: int, lora: bool, memory: Any, stream: torch.cuda.Stream, current: torch.cuda.Stream
    ) -> None:
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        plan = dataclasses.replace(self.plans[bs], lora=lora)
        ctx = ForwardContext(self.attention, self.pool, plan)
        self.attention.plan_decode_graph(None, bs)
        stream.wait_stream(current)
        # Warm up on the capture stream: lazy cuBLAS/NCCL setup and kernel JIT builds must not
        # happen during capture.
        with torch.cuda.stream(stream):
            self.model.compute_logits(self.model(ids, pos, ctx), out=self.logits[:bs])
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, memory, stream):
            self.outputs[(bs, lora)] = self.model.compute_logits(
                self.model(ids, pos, ctx), out=self.logits[:bs]
            )
        self.graphs[(bs, lora)] = graph
        current.wait_stream(stream)

    def padded_size(self, batch: ForwardBatch) -> int | None:
        """The captured size for this batch, or None when it must run eagerly."""
        return padded_size(batch.batch_size, self.sizes) if batch.is_decode else None

    def run(self, batch: ForwardBatch, graph_bs: int, *, lora: bool = False) -> torch.Tensor:
        """Logits [B, vocab] of a decode batch, through the graph for `graph_bs` (with the LoRA deltas,
        whose buffers the engine has planned, if `lora`): a view of the shared buffer, valid until the
        next replay (stream-ordered after whatever reads it first)."""
        n = batch.batch_size
        self.attention.plan_decode_graph(batch, graph_bs)
        # Stale ids/positions in padding rows are harmless: they are valid values from earlier batches.
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.graphs[(graph_bs, lora)].replay()
        return self.outputs[(graph_bs, lora)][:n]
