"""The arrays of a batch with drafts, staged with the rest of the batch in its one host-to-device copy.

A row with k drafts computes k + 1 tokens (its last known token, then the drafts) and is scored at all of
them, so the sampling arrays get one "sample row" per scored position: the request's slot repeated, and
the output index advanced by one per position (so min_tokens, seeds and the penalties' history, which
reaches the drafts through the token pool, are those of that output). Rows without drafts keep one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from tandem.engine.batch import ForwardBatch, SpecBatch
from tandem.scheduler.request import Request
from tandem.scheduler.staging import Staged, Staging

IntArray = npt.NDArray[np.int64]


class DraftedRow(Protocol):
    """What speculation reads of a scheduled row (batch_builder.Row, which imports this module)."""

    @property
    def req(self) -> Request: ...

    @property
    def samples(self) -> bool: ...

    @property
    def drafts(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class DraftSteps:
    """`draft_model`: K one-token batches over a batch's drafted rows (spec/draft_model.py); step j reads
    the token at position L-1+j from the pool (`input_ids` holds pool indices) and writes its draft at L+j."""

    batches: tuple[ForwardBatch, ...]
    outputs: tuple[torch.Tensor, ...]  # int64 [R] each: token-pool index the step's argmax goes to


@dataclass(frozen=True)
class SpecPrepared:
    """A prepared batch's drafts: the engine's SpecBatch and what the scheduler writes to the pool."""

    engine: SpecBatch
    draft_index: torch.Tensor  # int64 [D], device: token-pool index of each draft
    draft_ids: torch.Tensor  # int64 [D], device (-1 placeholders when a draft model writes them)
    draft_rows: torch.Tensor  # int64 [D], device: the sample row that checks each draft
    out_base: torch.Tensor  # int64 [B], device: token-pool index of each row's first output
    out_room: torch.Tensor  # int64 [B], device: outputs that fit before the row's end (0: keeps none)
    sample_of_row: tuple[int, ...]  # each row's first sample row
    drafts: tuple[int, ...]  # drafts per row
    draft_steps: DraftSteps | None = None  # set when a draft model writes the drafts on the device


@dataclass(frozen=True)
class StagedSpec:
    logit_index: int
    draft_ids: int
    grid: int
    draft_index: int
    draft_values: int
    draft_rows: int
    out_base: int
    out_room: int
    sample_slots: IntArray  # per sample row: the request's slot
    sample_lens: IntArray  # per sample row: the token-pool length before its sample
    sample_of_row: tuple[int, ...]
    drafts: tuple[int, ...]

    def build(self, sent: Staged, draft_steps: DraftSteps | None = None) -> SpecPrepared:
        dev = sent.device
        return SpecPrepared(
            SpecBatch(dev(self.logit_index), dev(self.draft_ids), dev(self.grid)),
            dev(self.draft_index),
            dev(self.draft_values),
            dev(self.draft_rows),
            dev(self.out_base),
            dev(self.out_room),
            self.sample_of_row,
            self.drafts,
            draft_steps,
        )


def stage_spec(
    stage: Staging,
    rows: Sequence[DraftedRow],
    slots: IntArray,
    lengths: IntArray,
    device_lens: IntArray,
    max_len: int,
) -> StagedSpec:
    """Stage the drafts of `rows` (some have none) for verification."""
    counts = np.fromiter((len(r.drafts) for r in rows), dtype=np.int64, count=len(rows))
    per_row = counts + 1
    first = np.cumsum(per_row) - per_row
    ends = np.cumsum(lengths)  # one past each row's last token in the batch
    row_of_sample = np.repeat(np.arange(len(rows)), per_row)
    j = np.arange(int(per_row.sum())) - first[row_of_sample]  # position within the row's scored tokens
    logit_index = ends[row_of_sample] - per_row[row_of_sample] + j
    flat_drafts = [t for r in rows for t in r.drafts]
    draft_ids = np.full(len(j), -1, dtype=np.int64)
    draft_ids[j < counts[row_of_sample]] = flat_drafts
    width = int(per_row.max())
    grid = np.full((len(rows), width), -1, dtype=np.int64)
    grid[row_of_sample, j] = np.arange(len(j))
    drafted = np.flatnonzero(counts > 0)
    base = slots * max_len + device_lens
    draft_index: IntArray | list[int] = (
        np.concatenate([base[b] + np.arange(counts[b]) for b in drafted]) if len(drafted) else []
    )
    samples = np.fromiter((r.samples for r in rows), dtype=bool, count=len(rows))
    room = np.where(samples, max_len - device_lens, 0)
    return StagedSpec(
        logit_index=stage.add(logit_index, np.int64),
        draft_ids=stage.add(draft_ids, np.int64),
        grid=stage.add(grid, np.int64),
        draft_index=stage.add(draft_index, np.int64),
        draft_values=stage.add(flat_drafts, np.int64),
        draft_rows=stage.add(np.flatnonzero(j < counts[row_of_sample]), np.int64),
        out_base=stage.add(base, np.int64),
        out_room=stage.add(room, np.int64),
        sample_slots=slots[row_of_sample],
        sample_lens=device_lens[row_of_sample] + j,
        sample_of_row=tuple(first.tolist()),
        drafts=tuple(counts.tolist()),
    )


def output_index(spec: SpecPrepared, accepted: torch.Tensor, spare: int) -> torch.Tensor:
    """int64 [B, W], device: where each emitted token goes in the token pool; the spare slot for the
    positions a row did not emit (rejected drafts' tokens are never written, so never read)."""
    width = spec.engine.grid.shape[1]
    j = torch.arange(width, device=accepted.device)[None, :]
    keep = j < torch.minimum(accepted, spec.out_room)[:, None]
    return torch.where(keep, spec.out_base[:, None] + j, spare)
