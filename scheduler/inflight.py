"""A batch between its launch and its processing (`InFlight`), and what the scheduler needs of the engine
to launch one (`EngineLike`)."""

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
from tandem.scheduler.batch_builder import PreparedBatch


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
