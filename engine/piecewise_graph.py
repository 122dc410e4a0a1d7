"""Piecewise CUDA graphs for prefill/extend: the layer pieces between attention calls, per token bucket.

A batch of T tokens runs on the smallest bucket >= T. Piece 0 is the embedding plus layer 0 up to its
attention; piece i finishes layer i-1 (o_proj, residual, norms, MLP; the TP all-reduces are captured
too) and runs layer i up to its attention; the last piece finishes the last layer and the final norm.
Attention runs eagerly between pieces, on the real tokens only, with metadata planned for this batch,
so variable lengths, prefixes and window-evicted page lists never enter a graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tandem.engine.batch import ForwardBatch
from tandem.engine.cuda_graph import capturing
from tandem.engine.graph_buckets import padded_size, token_buckets
from tandem.engine.kernel_plan import EAGER, KernelPlan, KernelPlanner
from tandem.engine.lora.runtime import EngineLora
from tandem.engine.models.common import CausalLM
from tandem.engine.models.context import ForwardContext

PieceFn = Callable[[torch.Tensor | None], torch.Tensor | None]


class PiecewiseGraphRunner:
    """Captures (or, with `use_graphs=False`, just runs) the model's pieces over static buffers.

    q/k/v and the final hidden state are copied into static buffers outside the graph pool: the
    memory of a piece's own outputs may be recycled by later captures, and eager attention must find
    them at a fixed place. The residual stream stays inside the pool: only the next piece reads it.
    Rows past the batch's T tokens are padding; every piece op works per token, so they never mix
    with real rows, and attention never sees them.

    Each bucket's `KernelPlan` is resolved once, here; without graphs every bucket runs the eager plan.
    With LoRA on, the pieces are captured with the layers' deltas only: a prefill batch's GEMMs dwarf the
    LoRA kernels' launches, so base batches run them too, over no tiles (the engine plans every batch).
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        max_tokens: int,
        device: torch.device,
        use_graphs: bool = True,
        planner: KernelPlanner | None = None,
        lora: EngineLora | None = None,
    ) -> None:
        body = model.model
        specs = {
            (s.num_heads, s.num_kv_heads, s.head_dim, s.stored_v_dim, s.out_dim) for s in model.layer_specs()
        }
        if len(specs) != 1:
            raise ValueError(f"piecewise graphs need one attention shape across layers, got {sorted(specs)}")
        heads, kv_heads, head_dim, v_dim, out_dim = specs.pop()
        self.body = body
        self.num_layers = len(body.layers)
        self.device = device
        self.use_graphs = use_graphs
        self.buckets = token_buckets(max_tokens)
        planner = planner or KernelPlanner()
        self.plans: dict[int, KernelPlan] = {
            t: dataclasses.replace(planner.piecewise(t) if use_graphs else EAGER, lora=lora is not None)
            for t in self.buckets
        }
        self.lora = lora
        t = self.buckets[-1]
        dtype = body.embed_tokens.weight.dtype
        hidden = body.embed_tokens.hidden_size
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.q = torch.zeros(t, heads, head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(t, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(t, kv_heads, v_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(t, heads * out_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, hidden, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def _pieces(self, t: int) -> list[PieceFn]:
        body, ids, pos, attn = self.body, self.input_ids[:t], self.positions[:t], self.attn_out[:t]
        plan = self.plans[t]

        def stash(piece: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, q, k, v = piece
            self.q[:t].copy_(q)
            self.k[:t].copy_(k)
            self.v[:t].copy_(v)
            return x

        def first(_: torch.Tensor | None) -> torch.Tensor:
            return stash(body.first_piece(ids, pos, plan))

        def middle(i: int) -> PieceFn:
            def piece(x: torch.Tensor | None) -> torch.Tensor:
                assert x is not None
                return stash(body.middle_piece(i, pos, x, attn, plan))

            return piece

        def last(x: torch.Tensor | None) -> None:
            assert x is not None
            self.hidden[:t].copy_(body.last_piece(x, attn, plan))

        return [first, *(middle(i) for i in range(1, self.num_layers)), last]

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        if self.lora is not None:
            self.lora.use_graph_buffers()
        torch.cuda.synchronize(self.device)
        stream.wait_stream(current)
        for t in reversed(self.buckets):  # largest first, so smaller buckets fit in its memory
            pieces = self._pieces(t)
            with torch.cuda.stream(stream):  # warm-up: no lazy initialisation during capture
                x = None
                for piece in pieces:
                    x = piece(x)
            graphs = []
            x = None
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                # The previous piece's residual stays referenced while this piece is captured, so
                # its memory is not reused until this piece has read it.
                with capturing(graph, memory, stream):
                    x = piece(x)
                graphs.append(graph)
            self.graphs[t] = graphs
        current.wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def padded_size(self, batch: ForwardBatch) -> int | None:
        """The bucket for this batch, or None when it has more tokens than the largest bucket."""
        return padded_size(batch.num_tokens, self.buckets)

    def run(self, batch: ForwardBatch, ctx: ForwardContext, bucket: int) -> torch.Tensor:
        """Final hidden states [T, hidden]; `ctx.attention` must already be planned for `batch`."""
        n = batch.num_tokens
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        graphs = self.graphs.get(bucket)
        pieces = self._pieces(bucket) if graphs is None else None
        x = None
        for i in range(self.num_layers + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                assert pieces is not None
                x = pieces[i](x)
            if i < self.num_layers:
                attn = self.body.layer(i).self_attn
                ctx.attention.forward(
                    attn.spec,
                    self.q[:n],
                    self.k[:n],
                    self.v[:n],
                    ctx.pool,
                    out=self.attn_out[:n],
                    sinks=attn.sink_logits,
                )
        return self.hidden[:n]
