"""The same greedy tokens as HF, and as each other, across every scheduler setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams

PROMPT_LENS = [3, 13, 60, 7, 33, 21, 90]
MAX_NEW = 24

SETTINGS: list[dict[str, Any]] = [
    {"overlap": True},
    {"overlap": False},
    {"prefix_cache": False},
    {"chunk_size": 16},
    {"chunk_size": 64},
    {"chunk_size": 1_000_000},
    {"page_size": 1},
    {"page_size": 16},
    {"max_running": 2},
    {"max_running": 2, "chunk_size": 16, "page_size": 1, "overlap": False},
]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def reference(request, tiny_model_dir) -> tuple[Path, list[list[int]], list[list[int]]]:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    return model_dir, prompts, ref


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_all_at_once_matches_hf(reference, setting: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, ref = reference
    llm = LLM(str(model_dir), device="cpu", **setting)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["kv_pages_used"] == 0


def test_one_at_a_time_matches_hf(reference) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, ref = reference
    llm = LLM(str(model_dir), device="cpu", chunk_size=16)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    for p, r in zip(prompts, ref):
        assert llm.generate([p], sp, use_tqdm=False)[0].token_ids == r
        assert llm.stats()["kv_pages_used"] == 0
