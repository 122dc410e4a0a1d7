"""The engine's LoRA state: the slot store every layer's delta reads, the batch buffers, and the two things
the scheduler asks of it: read an adapter for this rank, and load it into a slot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.engine.batch import ForwardBatch
from tandem.engine.config import ModelConfig
from tandem.engine.engine_config import LoraConfig
from tandem.engine.lora.batch import LoraBatchBuffers
from tandem.engine.lora.delta import LoraContext, LoraDelta, LoraOps, TorchLoraOps
from tandem.engine.lora.layout import LoraLayout
from tandem.engine.lora.peft_format import read_adapter
from tandem.engine.models.common import CausalLM

_EAGER_TOKENS = 8192  # the eager buffers' first size; a larger batch grows them (never inside a graph)


@dataclass(frozen=True)
class HostAdapter:
    """One adapter's deltas for this rank, in the slot layout, in host memory (pinned on CUDA)."""

    path: str
    rank: int
    flat: torch.Tensor  # [slot_numel] of the model dtype

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class EngineLora:
    """`max_loras` slots of every layer's A and B in one device store [slots, slot_numel], and the batch
    buffers their kernels read: fixed ones for the CUDA graphs (captured with them), growing ones for
    larger eager batches. Slot loads and batch plans go on the current (engine) stream, so they are
    ordered after the batches that read the old contents and before those that read the new."""

    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        config: LoraConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        graph_tokens: int,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.device = device
        self.dtype = dtype
        self.layout = LoraLayout.of(model, config.max_lora_rank)
        self.store = torch.zeros(config.max_loras, self.layout.slot_numel, dtype=dtype, device=device)
        self.graph = LoraBatchBuffers(graph_tokens, config.max_loras, device) if graph_tokens else None
        self.eager = self.graph or LoraBatchBuffers(_EAGER_TOKENS, config.max_loras, device)
        self.context = LoraContext(self.eager)
        ops: LoraOps = TorchLoraOps()
        if config.kernels == "triton":
            from tandem.engine.lora.triton_lora import TritonLoraOps

            ops = TritonLoraOps()
        for (linear, lay), (a, b) in zip(self.layout.linears, self.layout.views(self.store), strict=True):
            linear.lora = LoraDelta(a, b, lay, self.context, ops)  # type: ignore[assignment]

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_numel * self.store.element_size()

    def read(self, path: str) -> HostAdapter:
        """This rank's share of the adapter at `path`, checked against the model (AdapterError if it
        cannot be served), read into host memory in the slot layout."""
        adapter = read_adapter(path, self.model_config, self.config.max_lora_rank)
        pin = self.device.type == "cuda"
        flat = torch.zeros(self.layout.slot_numel, dtype=self.dtype, pin_memory=pin)
        self.layout.read(adapter, flat)
        return HostAdapter(str(Path(path)), adapter.rank, flat)

    def load(self, slot: int, adapter: HostAdapter) -> None:
        """Copy `adapter` into `slot` (its whole slot: ranks below the maximum are zeros), on the current
        stream, without waiting for it."""
        self.store[slot].copy_(adapter.flat, non_blocking=True)

    def plan(self, batch: ForwardBatch, *, graph: bool) -> None:
        """Write `batch`'s rows' slots into the buffers the forward reads: the graphs' (`graph`), else
        the eager ones, grown first if the batch is larger than they are."""
        slots = batch.lora_slots_cpu
        rows = batch.extend_lens_cpu.numpy()
        row_slots = (
            np.full(len(rows), -1, dtype=np.int32) if slots is None else slots.numpy().astype(np.int32)
        )
        if graph:
            assert self.graph is not None
            target = self.graph
        else:
            tokens = int(rows.sum())
            if tokens > self.eager.capacity:
                size = max(tokens, 2 * self.eager.capacity)
                self.eager = LoraBatchBuffers(size, self.config.max_loras, self.device)
            target = self.eager
        target.write(row_slots, rows)
        self.context.current = target

    def use_graph_buffers(self) -> None:
        """Before a capture: the kernels captured now read the graphs' buffers."""
        assert self.graph is not None
        self.context.current = self.graph
