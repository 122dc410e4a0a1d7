"""Speculative decoding on CUDA, with decode CUDA graphs on and the overlap loop on and off: greedy output
with drafts agrees with the same engine's output without them (the per-request switch; near-ties
excepted, see conftest), for n-gram drafts that hit and for a draft model equal to the target (every draft
accepted); and benchmarks/spec.py's replay run on the device."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.engine.tiny import default_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OPTIONS: dict[str, Any] = {"device": "cuda", "num_pages": 512, "cuda_graph_max_bs": 16}


def _recited() -> list[list[int]]:
    """The demo model recites its training text: a passage, then its start again, makes drafts hit."""
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    passage = tok((model_dir.parent / "corpus.txt").read_text()[:300])["input_ids"]
    return [passage + passage[:12], passage[:40] + passage[:8], [5, 6, 7, 5, 6, 7]]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_drafts_agrees_with_plain_decode(
    assert_same_greedy: Callable[[list[Any], list[Any]], None], overlap: bool, method: str
) -> None:
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec["model"] = str(default_model_dir())
    llm = LLM(str(default_model_dir()), overlap=overlap, speculative_config=spec, **OPTIONS)
    try:
        prompts = _recited()
        plain = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5, speculative=False)
        want = llm.generate(prompts, plain, use_tqdm=False)
        assert llm.stats()["spec_decode_num_drafts"] == 0
        drafted = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
        got = llm.generate(prompts, drafted, use_tqdm=False)
        # Mixed: a plain row beside drafted ones in the same batches.
        mixed = llm.generate(prompts, [plain, drafted, drafted], use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert_same_greedy(want, got)
    assert_same_greedy(want, mixed)
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_drafts"] > 0
    assert stats["kv_pages_used"] == 0


def test_replay_benchmark_runs_on_the_device(tmp_path: Path) -> None:
    from tandem.benchmarks.spec import ACCEPT_LENGTHS, main

    argv = ["--smoke", "--device", "cuda", "--tokens", "24", "--out-dir", str(tmp_path)]
    result = json.loads(main([*argv, "--model-dir", str(tmp_path / "m")]).read_text())
    measured = [result[f"accept_len_{n}"]["b2_accept_len"] for n in ACCEPT_LENGTHS]
    assert measured[0] == 1.0 and measured[-1] > measured[0]
    assert result["device"]["gpu"] and result["zero_accept_overhead"] > 0
