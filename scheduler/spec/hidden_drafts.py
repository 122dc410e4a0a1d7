"""`eagle3` and `mtp`: drafts from a head that reads the target's hidden states (engine/spec/head.py).

The scheduler's side, for both: after each target batch's tokens are stored, the head follows it (its
next-token inputs are the token pool shifted by one, so every position gets the token after it, the
batch's own samples included); a row's last accepted position is found on the device from the accept
counts. Before a batch with drafted rows, the builder's draft steps (spec/draft_model.py with lag 1) run
the head K times, each writing its greedy draft into the pool, as `draft_model` does. The host sees no
draft, no hidden state and no accept count here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, ForwardOutput, SamplingBatch
from tandem.engine.spec.hidden_drafter import HiddenDrafter
from tandem.scheduler.spec.staging import DraftSteps, SpecPrepared


class StoredBatch(Protocol):
    """What following a batch reads of it (batch_builder.PreparedBatch)."""

    @property
    def input_mapping(self) -> torch.Tensor: ...
    @property
    def positions(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> torch.Tensor: ...
    @property
    def extend_lens(self) -> torch.Tensor: ...
    @property
    def seq_lens_cpu(self) -> torch.Tensor: ...
    @property
    def extend_lens_cpu(self) -> torch.Tensor: ...
    @property
    def groups(self) -> tuple[AttentionGroupBatch, ...]: ...
    @property
    def sampling(self) -> SamplingBatch: ...
    @property
    def is_decode(self) -> bool: ...
    @property
    def spec(self) -> SpecPrepared | None: ...


class HiddenDrafts:
    """Feeds a HiddenDrafter the target's batches and runs its draft steps, on the engine stream."""

    def __init__(self, drafter: HiddenDrafter, max_seq_len: int) -> None:
        self.drafter = drafter
        self.max_seq_len = max_seq_len  # the token pool's row length: index // it is the slot

    def follow(self, batch: StoredBatch, output: ForwardOutput, pool: torch.Tensor) -> None:
        assert output.captured is not None, "the target captures hidden states for its drafter"
        ends = torch.cumsum(batch.extend_lens, 0)
        last = ends - 1
        if batch.spec is not None:  # a drafted row's last accepted position: `accepted` - 1 in
            assert output.accepted is not None
            scored = (batch.spec.engine.grid >= 0).sum(dim=1)
            last = last - (scored - output.accepted)
        index = batch.input_mapping
        slots = torch.div(index.index_select(0, last), self.max_seq_len, rounding_mode="floor")
        # Never past the pool: a slot's last entry + 1 is the next slot's first, or the spare entry.
        following = pool.index_select(0, index + 1)
        forward = ForwardBatch(
            input_ids=following,
            positions=batch.positions,
            seq_lens=batch.seq_lens,
            extend_lens=batch.extend_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            extend_lens_cpu=batch.extend_lens_cpu,
            groups=batch.groups,
            sampling=batch.sampling,
            is_decode=batch.is_decode,
        )
        self.drafter.follow(forward, output.captured, last, slots)

    def run_steps(self, steps: DraftSteps, pool: torch.Tensor) -> None:
        """The K draft steps (their `input_ids` are pool indices): each draft lands in the pool."""
        for batch, out in zip(steps.batches, steps.outputs, strict=True):
            slots = torch.div(batch.input_ids, self.max_seq_len, rounding_mode="floor")
            ids = pool.index_select(0, batch.input_ids)
            pool.index_copy_(0, out, self.drafter.step(replace(batch, input_ids=ids), slots))
