"""`draft_model`: a small model with the target's tokenizer drafts K tokens per row on the device.

The draft engine's KV pool has the target's page count and page size, so the scheduler's page tables
and KV slots serve both models: a page the target holds for a request holds the draft's KV of the same
tokens. The draft keeps its KV in step by running over every target batch (prefill chunks, plain and
drafted rows), and before a batch with drafted rows it runs K one-token steps over those rows, each
reading its input from the token pool and writing its argmax back there, where the target's inputs and
the drafts to verify are then gathered. The host never sees a draft: it stages positions only, and the
drafts stay on the device (the accept counts come back with the batch's tokens, as for n-gram).

Drafts are greedy (q one-hot), so verification by draw-equals-draft is exact rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch, StepLogits
from tandem.scheduler.spec.staging import DraftedRow, DraftSteps, SpecPrepared
from tandem.scheduler.staging import Staged, Staging
from tandem.scheduler.table import RequestTable


class DraftEngine(Protocol):
    """What the draft model's engine must offer (engine.Engine does)."""

    def step_logits(self, batch: ForwardBatch) -> StepLogits: ...


def stage_draft_steps(
    stage: Staging, rows: Sequence[DraftedRow], table: RequestTable, page_size: int, lag: int = 0
) -> list[tuple[int, ...]]:
    """Stage the arrays of the draft steps; `build_draft_steps` turns them into batches once sent.
    `lag`: positions the draft runs behind the tokens it reads (a hidden-state drafter at position p
    reads the token at p + 1: lag 1, see engine/spec/hidden_drafter.py)."""
    drafted = [r for r in rows if r.drafts]
    steps = max(len(r.drafts) for r in drafted)
    slots = np.array([r.req.slot for r in drafted], dtype=np.int64)
    lens = np.array([r.req.device_len for r in drafted], dtype=np.int64)  # L: the first draft's index
    counts = np.array([len(r.drafts) for r in drafted], dtype=np.int64)
    max_len = table.max_seq_len
    width = int((lens.max() + steps + page_size - 1) // page_size)
    pages = table.page_tables[0][slots, :width]
    staged: list[tuple[int, ...]] = []
    for j in range(steps):
        # Step j takes the rows with more than j drafts: a row's pages end at its last draft, and a
        # step past it would write KV through stale page-table entries.
        live = np.flatnonzero(counts > j)
        at, positions, rows_pages = slots[live], lens[live] - 1 - lag + j, pages[live]
        loc = rows_pages[np.arange(len(live)), positions // page_size].astype(np.int64) * page_size
        staged.append(
            (
                stage.add(at * max_len + positions + lag, np.int64),
                stage.add(at * max_len + positions + lag + 1, np.int64),
                stage.add(positions, np.int64),
                stage.add(positions + 1, np.int32),
                stage.add(np.ones(len(live)), np.int32),
                stage.add(rows_pages, np.int32),
                stage.add(np.zeros(len(live)), np.int32),
                stage.add(loc + positions % page_size, np.int64),
            )
        )
    return staged


def build_draft_steps(sent: Staged, staged: list[tuple[int, ...]], device: torch.device) -> DraftSteps:
    """The draft steps' batches; their input ids are gathered from `pool` when they run."""
    batches, outputs = [], []
    for inputs, out, pos, seq, ext, pages, start, loc in staged:
        rows = int(sent.host(seq).shape[0])
        batches.append(
            ForwardBatch(
                input_ids=sent.device(inputs),  # pool indices here; `run_draft_steps` gathers the ids
                positions=sent.device(pos),
                seq_lens=sent.device(seq),
                extend_lens=sent.device(ext),
                seq_lens_cpu=sent.host(seq),
                extend_lens_cpu=sent.host(ext),
                groups=(
                    AttentionGroupBatch(
                        page_table=sent.device(pages),
                        kv_start=sent.device(start),
                        out_cache_loc=sent.device(loc),
                        kv_start_cpu=sent.host(start),
                        page_table_cpu=sent.host(pages),
                    ),
                ),
                sampling=SamplingBatch.greedy(rows, device),
                is_decode=True,
            )
        )
        outputs.append(sent.device(out))
    return DraftSteps(tuple(batches), tuple(outputs))


def run_draft_steps(draft: DraftEngine, steps: DraftSteps, pool: torch.Tensor, vocab: int) -> None:
    """The K draft steps, on the current (engine) stream: each argmax lands in the pool for the next."""
    for batch, out in zip(steps.batches, steps.outputs, strict=True):
        ids = pool.index_select(0, batch.input_ids)
        logits = draft.step_logits(replace(batch, input_ids=ids)).logits
        pool.index_copy_(0, out, logits[:, :vocab].argmax(dim=-1))


def gather_drafts(spec: SpecPrepared, pool: torch.Tensor) -> SpecPrepared:
    """The SpecBatch with its draft ids read from the pool, where the draft steps wrote them."""
    ids = torch.full_like(spec.engine.draft_ids, -1)
    ids.index_copy_(0, spec.draft_rows, pool.index_select(0, spec.draft_index))
    return replace(spec, engine=replace(spec.engine, draft_ids=ids))
