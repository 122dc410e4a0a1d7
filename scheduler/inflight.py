"""A batch between its launch and its processing (`InFlight`), what the scheduler needs of the engine
to launch one (`EngineLike`), and the check that no page is reused while such a batch may read it
(`InflightPageGuard`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
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
from tandem.scheduler.batch_builder import PreparedBatch, Row


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
