"""Verification on the device: each row's accept count is one plus its leading drafts equal to the draw
at their position; rows without drafts emit their one draw; log-probs follow the same layout."""

from __future__ import annotations

import torch

from tandem.engine.batch import SpecBatch
from tandem.engine.sampler import SampleResult
from tandem.engine.spec.verify import verify


def test_accept_counts_stop_at_the_first_mismatch() -> None:
    # Row 0: drafts [5, 6, 7], draws [5, 6, 9, 4] -> 5, 6 accepted, then 9: three tokens.
    # Row 1: no drafts, draw [8] -> one token.  Row 2: drafts [2, 3], draws [2, 3, 1] -> all, plus 1.
    # Row 3: drafts [4], draws [0, 4] -> the first mismatches: one token (the draw 0).
    draws = torch.tensor([5, 6, 9, 4, 8, 2, 3, 1, 0, 4])
    drafts = torch.tensor([5, 6, 7, -1, -1, 2, 3, -1, 4, -1])
    grid = torch.tensor([[0, 1, 2, 3], [4, -1, -1, -1], [5, 6, 7, -1], [8, 9, -1, -1]])
    logprobs = -torch.arange(10, dtype=torch.float32)
    spec = SpecBatch(logit_index=torch.arange(10), draft_ids=drafts, grid=grid)
    checked = verify(SampleResult(draws, logprobs, None, None), spec)
    assert checked.accepted.tolist() == [3, 1, 3, 1]
    emitted = [checked.tokens[b, :n].tolist() for b, n in enumerate(checked.accepted.tolist())]
    assert emitted == [[5, 6, 9], [8], [2, 3, 1], [0]]
    assert checked.logprobs is not None
    assert checked.logprobs[2, :3].tolist() == [-5.0, -6.0, -7.0]
