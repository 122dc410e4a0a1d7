"""Verification of chain drafts against the target's samples, on the device, with no host sync.

Each scored position's token is drawn from the target's distribution there exactly as a step without
drafts would draw it (same penalties, biases, filters, and the same counter-based noise: seed and output
position). A draft is accepted while it equals that draw. For a deterministic drafter (n-gram, a greedy
draft model: q is one-hot on the draft d) this is rejection sampling exactly: the draw equals d with
probability p(d), the acceptance probability min(1, p(d) / q(d)); and a draw that differs from d is
distributed as p restricted to tokens other than d, renormalised, which is the residual
max(0, p - q) / (1 - p(d)). So the output distribution is the target's, and greedy rows (argmax draws)
are exact. A seeded request even emits the very tokens it would without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.batch import SpecBatch
from tandem.engine.sampler import SampleResult


@dataclass(frozen=True)
class VerifiedResult:
    """Per row and position: the draws (row b emitted its first `accepted[b]`), and their log-probs."""

    tokens: torch.Tensor  # int64 [B, W]
    accepted: torch.Tensor  # int64 [B], in 1..k_b + 1
    logprobs: torch.Tensor | None  # float32 [B, W]
    top_ids: torch.Tensor | None  # int64 [B, W, n]
    top_logprobs: torch.Tensor | None  # float32 [B, W, n]


def verify(sampled: SampleResult, spec: SpecBatch) -> VerifiedResult:
    """Lay the sample rows out per batch row and count each row's leading accepted drafts, plus one."""
    grid = spec.grid
    index = grid.clamp(min=0)
    tokens = sampled.next_tokens[index]
    # Padding and the bonus position check the draft -1, which no draw equals: the run stops there.
    drafts = torch.where(grid >= 0, spec.draft_ids[index], -1)
    accepted = (tokens == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1) + 1

    def per_position(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[index]

    return VerifiedResult(
        tokens,
        accepted,
        per_position(sampled.logprobs),
        per_position(sampled.top_ids),
        per_position(sampled.top_logprobs),
    )
