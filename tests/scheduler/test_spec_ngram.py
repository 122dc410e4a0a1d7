"""Speculative decoding with n-gram drafts: greedy output equals HF's token for token (drafts that hit,
drafts that miss, every loop), and sampling keeps the target's distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.engine.tiny import default_model_dir
from tandem.scheduler.spec.ngram import propose_ngram

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    tokens = np.array([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3], dtype=np.int64)
    assert propose_ngram(tokens, 3, 1, 4) == [9, 2, 3]  # "1 2 3" beats the later "2 3"
    assert propose_ngram(tokens, 3, 1, 2) == [8, 7, 1]  # "2 3", latest earlier occurrence
    assert propose_ngram(np.array([4, 5, 6], dtype=np.int64), 3, 1, 4) == []
    assert propose_ngram(tokens, 0, 1, 4) == []


@pytest.fixture(scope="module")
def recited() -> tuple[Path, list[list[int]], list[list[int]]]:
    """The demo model recites its training text: a passage, then its start again, makes drafts hit."""
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    corpus = (model_dir.parent / "corpus.txt").read_text()
    passage = tok(corpus[:300])["input_ids"]
    other = tok(corpus[2000:2300])["input_ids"]
    prompts = [passage + passage[:12], passage[:40], other + other[:8], [5, 6, 7]]
    return model_dir, prompts, _hf_greedy(model_dir, prompts, 28)


SETTINGS: list[dict[str, Any]] = [
    {"overlap": True},
    {"overlap": False},
    {"overlap": True, "page_size": 1, "chunk_size": 16},
    {"overlap": False, "prefix_cache": False, "max_running": 2},
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_greedy_with_hitting_drafts_matches_hf(recited, setting: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, ref = recited
    llm = LLM(str(model_dir), device="cpu", speculative_config=NGRAM, **setting)
    greedy = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == ref
    stats = llm.stats()
    assert stats["kv_pages_used"] == 0
    # The recited passages accept whole drafts: more than one token per verified row on average.
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_drafts"]
    assert stats["spec_decode_mean_acceptance_length"] > 2.0
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # position j is accepted only after j - 1
    # Cached prefixes hold accepted tokens only: the same prompts again, from the cache, agree.
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == ref
    llm.shutdown()


def test_greedy_with_missing_drafts_matches_hf(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A random model's continuation of a prompt that holds its own earlier continuation: drafts are
    found (its tokens occur earlier) but often rejected (the context differs); output is exact."""
    model_dir = tiny_model_dir("qwen3")
    g = torch.Generator().manual_seed(3)
    starts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 9, 4)]
    earlier = _hf_greedy(model_dir, starts, 12)
    prompts = [s + e + s for s, e in zip(starts, earlier, strict=True)]
    ref = _hf_greedy(model_dir, prompts, 20)
    for overlap in (True, False):
        llm = LLM(str(model_dir), device="cpu", overlap=overlap, speculative_config=NGRAM)
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
        assert [o.token_ids for o in outs] == ref
        stats = llm.stats()
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
        llm.shutdown()


def test_stops_max_tokens_and_logprobs_see_accepted_tokens_only(recited) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, ref = recited
    plain = LLM(str(model_dir), device="cpu")
    spec = LLM(str(model_dir), device="cpu", speculative_config=NGRAM)
    stop_at = ref[0][9]  # a token met mid-draft
    cases = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=28, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True),
    ]
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        for a, b in zip(got, want, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert [[t for t, _ in top] for top in a.top_logprobs] == [
                [t for t, _ in top] for top in b.top_logprobs
            ]
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    plain.shutdown()
    spec.shutdown()


def test_seeded_sampling_draws_the_same_tokens_with_drafts(recited) -> None:  # type: ignore[no-untyped-def]
    """Each position is drawn with the noise of its own output index, so a seeded request emits the very
    tokens it would emit without drafts, under filters, penalties and biases alike."""
    model_dir, prompts, _ = recited
    plain = LLM(str(model_dir), device="cpu")
    spec = LLM(str(model_dir), device="cpu", speculative_config=NGRAM)
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=5, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, repetition_penalty=1.3, seed=13, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.5, logit_bias={7: 3.0}, min_tokens=5, seed=14),
    ]
    for p in params:
        want = [o.token_ids for o in plain.generate(prompts, p, use_tqdm=False)]
        assert [o.token_ids for o in spec.generate(prompts, p, use_tqdm=False)] == want
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    plain.shutdown()
    spec.shutdown()
