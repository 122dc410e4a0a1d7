"""Hidden-state drafters on the GPU (bf16, flashinfer): an EAGLE-3 head over Llama-3.1-8B's head layout
and DeepSeek-V3's MTP layer over flashinfer's MLA shape, in both loops. A random head changes nothing
(bf16 near-ties aside, against the same target without drafts); a head built to agree with a repeating
target has every draft accepted, so its KV pages, page tables and per-slot hidden states are right on
the device as on the CPU."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams

from ..engine.spec_heads import repeating, with_mtp_layer, write_eagle3
from .test_mla_gpu import V2_LITE_ATTENTION

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
# Llama-3.1-8B's head layout (GQA 4), four layers so the head reads three distinct ones.
LLAMA_8B_HEADS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
V3_MLA = {k: v for k, v in V2_LITE_ATTENTION.items() if k != "topk_method"}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 200, (8,), generator=g)
    ]


def _run(model_dir: Path, prompts: list[list[int]], **options: Any) -> tuple[list[Any], dict[str, Any]]:
    llm = LLM(str(model_dir), device="cuda", num_pages=512, chunk_size=64, **options)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs, stats


def _all_accepted(stats: dict[str, Any]) -> bool:
    drafted = stats["spec_decode_num_draft_tokens"]
    return bool(drafted > 0 and stats["spec_decode_num_accepted_tokens"] == drafted)


@pytest.mark.parametrize("overlap", [True, False])
def test_eagle3_on_the_gpu(
    tiny_model_dir: Callable[..., Path],
    tmp_path: Path,
    assert_same_greedy: Callable[..., None],
    overlap: bool,
) -> None:
    target = tiny_model_dir("llama", **LLAMA_8B_HEADS)
    prompts = _prompts()
    plain, _ = _run(target, prompts, overlap=overlap)
    head = write_eagle3(tmp_path / "random", target, draft_vocab=256, keep=[])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    outs, stats = _run(target, prompts, overlap=overlap, speculative_config=spec)
    assert_same_greedy(plain, outs)
    assert stats["spec_decode_num_draft_tokens"] > 0
    rep = repeating(target, tmp_path / "repeating")
    agree = write_eagle3(tmp_path / "agree", rep, draft_vocab=128, keep=[p[-1] for p in prompts], agree=True)
    spec = {"method": "eagle3", "model": str(agree), "num_speculative_tokens": 4}
    outs, stats = _run(rep, prompts, overlap=overlap, speculative_config=spec)
    assert [o.token_ids for o in outs] == [[p[-1]] * GREEDY.max_tokens for p in prompts]
    assert _all_accepted(stats)


def test_mtp_on_the_gpu(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    target = tiny_model_dir("deepseek_v3", **V3_MLA)
    prompts = _prompts()
    rep = repeating(target, tmp_path / "repeating")
    agree = with_mtp_layer(rep, tmp_path / "agree", agree=True)
    for overlap in (True, False):
        spec = {"method": "mtp", "num_speculative_tokens": 3}
        outs, stats = _run(agree, prompts, overlap=overlap, speculative_config=spec)
        assert [o.token_ids for o in outs] == [[p[-1]] * GREEDY.max_tokens for p in prompts]
        assert _all_accepted(stats)
