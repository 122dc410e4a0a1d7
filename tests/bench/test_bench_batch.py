"""benchmarks/batch.py sends `tandem.batch` the offline benchmark's requests, draw for draw (its tiny CPU
preset folds the same draws into the tiny vocabulary), and the engine options LLM.generate gets."""

from __future__ import annotations

import argparse

from tandem.benchmarks.batch import PRESETS, engine_options, requests
from tandem.benchmarks.offline import pages_for, workload


def args_of(preset: str) -> argparse.Namespace:
    values = {"num_seqs": 256, "min_input": 100, "max_input": 1024, "min_output": 100, "max_output": 1024}
    values.update(PRESETS[preset])
    return argparse.Namespace(**values, max_running=256, chunk_size=8192)


def test_the_full_preset_is_the_offline_workload() -> None:
    args = args_of("qwen3-0.6b")
    prompts, params = requests(args, 151_936)
    want_prompts, want_params = workload(args)
    assert prompts == want_prompts and params == want_params
    assert sum(p.max_tokens for p in params) == 133_966
    assert engine_options(args, prompts, params) == {
        "page_size": 16,
        "num_pages": pages_for(prompts, params),
        "max_running": 256,
        "chunk_size": 8192,
    }


def test_the_tiny_preset_folds_the_same_draws() -> None:
    args = args_of("tiny")
    prompts, params = requests(args, 512)
    raw, _ = workload(args)
    assert len(prompts) == 24 and [len(p) for p in prompts] == [len(p) for p in raw]
    assert all(0 <= t < 512 for p in prompts for t in p)
    assert all(8 <= p.max_tokens <= 32 for p in params)
