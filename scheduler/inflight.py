"""A batch between its launch and its processing (`InFlight`), what the scheduler needs of the engine
to launch one (`EngineLike`), the launch itself (`Launcher`), and the check that no page is reused while
such a batch may read it (`InflightPageGuard`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from tandem.engine.batch import (
    ForwardBatch,
    ForwardOutput,
    PromptLogprobs,
    SamplingBatch,
    SpecBatch,
    StepLogits,
)
from tandem.engine.streams import StreamSet
from tandem.scheduler.batch_builder import PreparedBatch, Row
from tandem.scheduler.spec.decoding import SpecDecoding
from tandem.scheduler.spec.staging import output_index
from tandem.scheduler.structured.grammar import BitmaskFiller
from tandem.scheduler.table import RequestTable


class EngineLike(Protocol):
    """What the scheduler needs of the engine."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...

    def step_logits(self, batch: ForwardBatch) -> StepLogits: ...

    def sample(
        self,
        logits: torch.Tensor,
        sampling: SamplingBatch,
        prompt: PromptLogprobs | None = None,
        spec: SpecBatch | None = None,
        captured: torch.Tensor | None = None,
    ) -> ForwardOutput: ...


@dataclass
class InFlight:
    """A launched batch whose results have not been processed yet.

    A batch with structured-output rows is launched in two halves: the forward (`logits`), then,
    once the tokens before it are accepted by their matchers, the masked sample that sets `output`.
    """

    prepared: PreparedBatch
    output: ForwardOutput | None
    sampling: SamplingBatch | None = None  # set while the sample is pending
    logits: StepLogits | None = None
    grammar_rows: list[int] | None = None  # batch rows with a matcher that sample this step
    bitmask: Future[torch.Tensor] | None = None  # their masks, being filled on the filler's worker


class Launcher:
    """Turns a PreparedBatch into an InFlight one on the engine: the token-pool gathers, the drafts, the
    forward and the (possibly deferred, grammar-masked) sample, then the sampled tokens written back into
    the token pool. All of it runs on the engine stream (masks go up on the copy stream); split from the
    Scheduler along that seam, it reads no request's host-side lengths."""

    def __init__(
        self, engine: EngineLike, table: RequestTable, streams: StreamSet, spec: SpecDecoding | None
    ) -> None:
        self.engine = engine
        self.table = table
        self.streams = streams
        self.device = streams.device
        self.spec = spec
        self._bitmasks: BitmaskFiller | None = None  # made with the first constrained batch

    def launch(self, prepared: PreparedBatch, defer_masks: bool = False) -> InFlight:
        """Start the batch on the engine. A batch with structured-output rows only runs its forward here
        when `defer_masks` (the overlap loop: their previous tokens are not accepted yet); `sample`
        finishes it once they are."""
        pool = self.table.token_pool
        if prepared.spec is not None:  # the drafts are inputs, and the penalties' history, of their rows
            assert self.spec is not None
            prepared = replace(prepared, spec=self.spec.prepare(prepared.spec, pool))
        spec = prepared.spec
        # index_select and index_copy_ rather than tensor indexing: the same kernels' work for a fraction
        # of the host time, which a small model's step is made of.
        input_ids = pool.index_select(0, prepared.input_mapping)
        sampling = prepared.sampling
        if prepared.history_index is not None:
            index = prepared.history_index
            history = torch.where(index >= 0, pool[index], torch.full_like(index, -1))
            sampling = replace(sampling, history=history)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=prepared.positions,
            seq_lens=prepared.seq_lens,
            extend_lens=prepared.extend_lens,
            seq_lens_cpu=prepared.seq_lens_cpu,
            extend_lens_cpu=prepared.extend_lens_cpu,
            groups=prepared.groups,
            sampling=sampling,
            is_decode=prepared.is_decode,
            lora_slots_cpu=prepared.lora_slots_cpu,
            prompt_logprobs=prepared.prompt_logprobs,
            spec=None if spec is None else spec.engine,
        )
        if self.spec is not None:
            self.spec.follow(batch)
        rows = prepared.rows
        grammar_rows = [i for i, row in enumerate(rows) if row.samples and row.req.grammar is not None]
        if not grammar_rows:
            output = self.engine.forward(batch)
            self._store(prepared, output)
            return InFlight(prepared, output)
        flight = InFlight(prepared, None, batch.sampling, self.engine.step_logits(batch), grammar_rows)
        if not defer_masks:
            self.sample(flight)
        return flight

    def start_masks(self, flight: InFlight) -> None:
        """Start filling the bitmasks of a batch launched with its sample pending. Every earlier batch's
        tokens have been accepted by now, so each matcher is where this step's token is drawn."""
        assert flight.grammar_rows is not None
        rows = flight.prepared.rows
        states = [state for i in flight.grammar_rows if (state := rows[i].req.grammar) is not None]
        if self._bitmasks is None:
            self._bitmasks = BitmaskFiller(pin=self.device.type == "cuda")
        flight.bitmask = self._bitmasks.start(states)

    def sample(self, flight: InFlight) -> None:
        """Mask, sample and store the tokens of a batch launched with its sample pending."""
        assert flight.sampling is not None and flight.logits is not None and flight.grammar_rows is not None
        if flight.bitmask is None:
            self.start_masks(flight)
        assert flight.bitmask is not None and self._bitmasks is not None
        grammars = [flight.prepared.rows[i].req.grammar for i in flight.grammar_rows]
        vocab = max(g.vocab_size for g in grammars if g is not None)  # one tokenizer: all alike
        # The masks go up on the copy stream: queued on the engine stream, the copy would wait for the
        # forward still running there and then hold up the sample; on its own stream it overlaps them.
        mask_rows = flight.grammar_rows
        if flight.prepared.spec is not None:  # a batch with drafts samples per scored position
            mask_rows = [flight.prepared.spec.sample_of_row[i] for i in mask_rows]
        with self.streams.use(self.streams.copy):
            bitmask, index = self._bitmasks.upload(flight.bitmask.result(), mask_rows, self.device)
            self.streams.hand_over((bitmask, index), to=self.streams.engine)
        sampling = replace(flight.sampling, bitmask=bitmask, bitmask_rows=index, bitmask_vocab=vocab or None)
        spec = flight.prepared.spec
        step = flight.logits
        flight.output = self.engine.sample(
            step.logits, sampling, step.prompt, None if spec is None else spec.engine, step.captured
        )
        self._store(flight.prepared, flight.output)
        flight.sampling = flight.logits = flight.bitmask = None

    def _store(self, prepared: PreparedBatch, output: ForwardOutput) -> None:
        """Write the batch's tokens into the token pool, on the device: with drafts, each row's emitted
        tokens only (the accept counts never leave the device here)."""
        pool = self.table.token_pool
        if prepared.spec is None:
            pool.index_copy_(0, prepared.output_mapping, output.next_tokens)
        else:
            assert output.accepted is not None
            index = output_index(prepared.spec, output.accepted, self.table.spare)
            pool.index_copy_(0, index.reshape(-1), output.next_tokens.reshape(-1))
        if self.spec is not None:  # a hidden-state drafter follows the batch once its tokens are in
            self.spec.stored(prepared, output, pool)


class InflightPageGuard:
    """The `guard_inflight_pages` check (tests and stress runs): the (group, page) pairs each launched,
    not yet processed batch may read, and an error where a row is handed one of them: the deferred-release
    rule (a freed page is reused only after every in-flight batch that could read it finished) broken."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._reads: dict[int, set[tuple[int, int]]] = {}

    def launched(self, batch_id: int, rows: list[Row]) -> None:
        if self.on:
            self._reads[batch_id] = {
                (g, p) for r in rows for g, pages in enumerate(r.req.pages) for p in pages[r.req.evicted[g] :]
            }

    def processed(self, batch_id: int) -> None:
        self._reads.pop(batch_id, None)

    def check_new(self, group: int, pages: list[int]) -> None:
        for batch_id, used in self._reads.items():
            for page in pages:
                if (group, page) in used:
                    raise AssertionError(
                        f"page {page} of group {group} reused while batch {batch_id} may read it"
                    )
