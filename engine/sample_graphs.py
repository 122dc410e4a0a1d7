"""The one-pass sampling race replayed as a CUDA graph per decode-graph size.

The race is two Triton launches whose Python launchers cost the host more than the kernels cost the
device at small batches, and a batch-1 step is host-bound. Captured, a draw is a few small copies into
static buffers and one replay. Each size has two graphs, on the decode graphs' shared logits buffer:
- plain: every row unconstrained;
- masked: rows listed in a static row buffer (-1 pads it to the batch size, and never matches a row) read
  their packed xgrammar bitmask from a static buffer as wide as the model's vocabulary.

The masked graph is captured for the whole vocabulary, so the tokenizer's bound (`bitmask_vocab`) is
carried by the bits: the static bitmask's words past the grammar's are zero (never written), and the
bits past `bitmask_vocab` in the grammar's last word are cleared after each copy. So both graphs draw
exactly the tokens the eager race draws on the same batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.engine.batch import SamplingBatch
from tandem.engine.cuda_graph import capturing


class RaceCall(Protocol):
    """The sampler's one-pass race on explicit tensors (`Sampler.race_call`): bitmask and rows None for
    a batch without structured-output rows."""

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        steps: torch.Tensor,
        bitmask: torch.Tensor | None,
        bitmask_rows: torch.Tensor | None,
    ) -> torch.Tensor: ...


class SampleGraphs:
    """`race` captured for every size in `sizes` over `logits[:size]`, plain and masked."""

    def __init__(self, race: RaceCall, logits: torch.Tensor, sizes: list[int], vocab_size: int) -> None:
        device = logits.device
        self.race = race
        self.logits = logits
        self.sizes = sizes
        max_bs = sizes[-1]
        self.temperature = torch.ones(max_bs, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.steps = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.words = -(-vocab_size // 32)
        self.bitmask = torch.zeros(max_bs, self.words, dtype=torch.int32, device=device)
        self.bitmask_rows = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self._width = self.words  # the last copied bitmask's; wider columns stay zero
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.tokens: dict[tuple[int, bool], torch.Tensor] = {}

    def _draw(self, bs: int, masked: bool) -> torch.Tensor:
        rows = self.bitmask_rows[:bs] if masked else None
        bitmask = self.bitmask if masked else None
        return self.race(
            self.logits[:bs], self.temperature[:bs], self.seeds[:bs], self.steps[:bs], bitmask, rows
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph into one memory pool of their own, each warmed up first on the capture
        stream (Triton builds the variant of each launch shape before capture, never during it)."""
        device = self.logits.device
        memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        torch.cuda.synchronize(device)
        for bs in reversed(self.sizes):
            for masked in (False, True):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    self._draw(bs, masked)
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, memory, stream):
                    self.tokens[bs, masked] = self._draw(bs, masked)
                self.graphs[bs, masked] = graph
                current.wait_stream(stream)
        torch.cuda.synchronize(device)

    def fits(self, sampling: SamplingBatch) -> bool:
        """Whether the batch's bitmask (if any) fits the static one."""
        return sampling.bitmask is None or sampling.bitmask.shape[1] <= self.words

    def run(self, sampling: SamplingBatch, rows: int, graph_bs: int) -> torch.Tensor:
        """int64 [rows]: the tokens of the batch's first `rows` rows, whose logits the decode graph of
        `graph_bs` has just written. A fresh tensor: the graph's own output is overwritten next step,
        possibly before the copy stream has read it."""
        self.temperature[:rows].copy_(sampling.temperature)
        self.seeds[:rows].copy_(sampling.seeds)
        self.steps[:rows].copy_(sampling.steps)
        masked = sampling.bitmask is not None
        if sampling.bitmask is not None:
            assert sampling.bitmask_rows is not None
            listed, width = sampling.bitmask.shape
            if width != self._width:  # one tokenizer per engine: in practice, the first masked batch
                self.bitmask.zero_()
                self._width = width
            self.bitmask[:listed, :width].copy_(sampling.bitmask)
            # Ids from the tokenizer's bound on are never allowed: clear their bits.
            full, bits = divmod(min(sampling.bitmask_vocab or 32 * width, 32 * width), 32)
            if full < width:
                self.bitmask[:listed, full].bitwise_and_((1 << bits) - 1)
                if full + 1 < width:
                    self.bitmask[:listed, full + 1 : width].zero_()
            self.bitmask_rows[:listed].copy_(sampling.bitmask_rows)
            self.bitmask_rows[listed:graph_bs].fill_(-1)
        self.graphs[graph_bs, masked].replay()
        return self.tokens[graph_bs, masked][:rows].clone()
