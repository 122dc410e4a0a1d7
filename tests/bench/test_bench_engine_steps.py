"""The engine-level benchmarks' sampling batch carries the host flags its values imply, as the scheduler's
batch builder would set them: otherwise the sampler takes slow paths no such request takes in serving."""

from __future__ import annotations

import torch

from tandem.benchmarks.engine_steps import sampling


def test_host_flags_match_the_rows() -> None:
    batch = sampling(8, torch.device("cpu"))
    assert batch.any_top_k_top_p == bool(((batch.top_k > 0) | (batch.top_p < 1.0)).any())
    assert batch.any_min_p == bool((batch.min_p > 0).any())
    assert batch.all_greedy == bool((batch.temperature == 0).all())
    # No benchmark row brings its own seed, so the sampler may use its generator.
    assert not batch.any_explicit_seed
