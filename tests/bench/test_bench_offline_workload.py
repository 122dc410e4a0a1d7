"""The offline benchmark's workload is nano-vllm's bench.py workload, draw for draw: after random.seed(0),
256 prompts of U(100, 1024) ids from randint(0, 10000), then 256 output lengths U(100, 1024)."""

from __future__ import annotations

import argparse
import random

import torch

from tandem.benchmarks.offline import workload


def test_the_draws_follow_nano_vllm() -> None:
    args = argparse.Namespace(num_seqs=256, min_input=100, max_input=1024, min_output=100, max_output=1024)
    prompts, params = workload(args)
    # nano-vllm's bench.py, inline: every prompt first, then every output length.
    random.seed(0)
    want_prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    want_outputs = [random.randint(100, 1024) for _ in range(256)]
    assert prompts == want_prompts
    assert [p.max_tokens for p in params] == want_outputs
    assert sum(want_outputs) == 133_966  # the figure the benchmark is specified with
    assert all(p.temperature == 0.6 and p.ignore_eos for p in params)


def test_allocator_counter_deltas() -> None:
    from tandem.benchmarks.common import allocator_counters, counter_deltas

    assert counter_deltas({"pinned_allocs": 3}, {"pinned_allocs": 5, "device_mallocs": 2}) == {
        "pinned_allocs": 2,
        "device_mallocs": 2,
    }
    if not torch.cuda.is_available():
        assert allocator_counters() == {}  # nothing to count off CUDA


def test_pages_for_holds_every_sequence_at_once() -> None:
    from tandem.benchmarks.offline import pages_for
    from tandem.scheduler.sampling_params import SamplingParams

    prompts = [[1] * 100, [2] * 17]
    params = [SamplingParams(max_tokens=28), SamplingParams(max_tokens=1)]
    # 128 tokens -> 8 pages of 16, 18 tokens -> 2 pages: 10 pages, 10% slack and 64 spare.
    assert pages_for(prompts, params) == int(10 * 1.1) + 64
