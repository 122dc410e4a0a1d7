"""The LoRA delta of one linear layer, added to the layer's output for every row of a batch at once.

A `LoraDelta` is attached to a column- or row-parallel layer when LoRA is on; the layer adds it after its
own GEMM (before a row layer's all-reduce) when the forward's `KernelPlan` says the batch has adapter rows.
The rows' slots come from the engine's `LoraBatchBuffers` of the forward (`LoraContext.current`): the
decode graphs' fixed buffers while they are captured and replayed, the eager ones otherwise.

`TorchLoraOps` is the reference (CPU, and CUDA without Triton): a gathered product over every slot with a
one-hot mask of each token's slot, so it is a fixed sequence of tensor ops whatever the batch (it runs in
CUDA graphs too), and never one matmul per adapter in a Python loop. On CUDA with Triton the products are
`triton_lora.py`'s two batched kernels; in a one-row decode graph whose GEMM is the Triton GEMV, the
second of them is folded into the GEMV's epilogue (`fold`, engine/layers/low_rank.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.engine.kernel_plan import KernelPlan
from tandem.engine.layers.low_rank import GemvDelta
from tandem.engine.lora.batch import LoraBatchBuffers
from tandem.engine.lora.layout import LinearLayout


class LoraContext:
    """Which batch buffers the forward reads: one per engine, shared by its layers' deltas."""

    def __init__(self, current: LoraBatchBuffers) -> None:
        self.current = current


class LoraOps(Protocol):
    def add(self, x: torch.Tensor, out: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> None:
        """out += the delta of each row's slot applied to x (rows without a slot unchanged)."""
        ...

    def fold(self, x: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> GemvDelta | None:
        """x's shrink, launched now, as the Triton GEMV's epilogue takes it; None where these ops do not
        fold (the layer then calls `add`)."""
        ...


class LoraDelta:
    """A [S, slices x R, in] and B [S, out, R] of one layer (views of the engine's slot store)."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        layout: LinearLayout,
        context: LoraContext,
        ops: LoraOps,
    ) -> None:
        self.a, self.b, self.layout, self.context, self.ops = a, b, layout, context, ops
        self.rank = layout.rank
        # (offset, size) of each slice in the layer's output, for the kernels (read as constants).
        pairs = [v for s in layout.slices for v in (s.offset, s.size)]
        self.slices = torch.tensor(pairs, dtype=torch.int32, device=a.device)
        self.slice_offsets = tuple(s.offset for s in layout.slices)
        self.max_slice = max(s.size for s in layout.slices)

    @property
    def batch(self) -> LoraBatchBuffers:
        return self.context.current

    def add(self, x: torch.Tensor, out: torch.Tensor, plan: KernelPlan) -> None:
        self.ops.add(x, out, self, plan)

    def fold(self, x: torch.Tensor, plan: KernelPlan) -> GemvDelta | None:
        return self.ops.fold(x, self, plan)


class TorchLoraOps:
    """The reference: x against every slot's A, masked to each token's own slot, then against every B."""

    def fold(self, x: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> GemvDelta | None:
        return None

    def add(self, x: torch.Tensor, out: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> None:
        tokens = x.shape[0]
        slots = delta.a.shape[0]
        r = delta.rank
        owner = delta.batch.token_slots[:tokens].long()
        mask = (owner[:, None] == torch.arange(slots, device=x.device)[None, :]).to(x.dtype)
        shrunk = torch.einsum("tk,snk->tsn", x, delta.a) * mask[:, :, None]
        for j, piece in enumerate(delta.layout.slices):
            b = delta.b[:, piece.offset : piece.offset + piece.size]
            part = torch.einsum("tsr,sor->to", shrunk[:, :, j * r : (j + 1) * r], b)
            out[:, piece.offset : piece.offset + piece.size] += part
