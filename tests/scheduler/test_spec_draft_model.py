"""Speculative decoding with a draft model: exact against HF with a draft equal to the target (every
draft accepted) and with a random one (almost none), in both loops; seeded sampling as without drafts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def target(tiny_model_dir):  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 13, 30)]
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    return model_dir, prompts, ref


def _spec(draft: object) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


@pytest.mark.parametrize("overlap", [True, False])
def test_a_draft_equal_to_the_target_has_every_draft_accepted(target, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, ref = target
    llm = LLM(str(model_dir), device="cpu", overlap=overlap, speculative_config=_spec(model_dir))
    # Different max_tokens: near their ends rows draft fewer than K tokens beside rows drafting K.
    lengths = [20, 17, 19]
    greedy = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    ref = [r[:n] for r, n in zip(ref, lengths, strict=True)]
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == ref
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_mean_acceptance_length"] > K  # K + 1 but where max_tokens capped the drafts
    assert stats["kv_pages_used"] == 0
    # From the prefix cache (the draft's KV shares the target's pages): still exact, still all accepted.
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == ref
    assert llm.stats()["spec_decode_num_accepted_tokens"] == llm.stats()["spec_decode_num_draft_tokens"]
    llm.shutdown()


def test_a_random_draft_changes_nothing(target, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, ref = target
    poor = tiny_model_dir("qwen3", seed=5)
    llm = LLM(str(model_dir), device="cpu", chunk_size=16, page_size=1, speculative_config=_spec(poor))
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 4 * stats["spec_decode_num_accepted_tokens"]
    llm.shutdown()


def test_seeded_sampling_with_a_draft_model_is_the_target_s(target, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, _ = target
    plain = LLM(str(model_dir), device="cpu")
    spec = LLM(str(model_dir), device="cpu", speculative_config=_spec(model_dir))
    for p in (
        SamplingParams(max_tokens=16, temperature=0.9, seed=3),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.8, presence_penalty=0.5, seed=4),
    ):
        want = [o.token_ids for o in plain.generate(prompts, p, use_tqdm=False)]
        assert [o.token_ids for o in spec.generate(prompts, p, use_tqdm=False)] == want
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    plain.shutdown()
    spec.shutdown()


def test_a_draft_of_another_vocabulary_is_refused(target, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model_dir, _, _ = target
    wide = tiny_model_dir("qwen3", vocab_size=4096)
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        LLM(str(model_dir), device="cpu", speculative_config=_spec(wide))


@pytest.mark.parametrize("overlap", [True, False])
def test_grammar_rows_share_batches_with_drafted_rows(target, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    """Structured-output rows never draft, but run in the same batches as drafted rows: their masks
    land on their own sample rows, their outputs are the ones without drafts, and the rest stay exact."""
    from tandem.scheduler.sampling_params import StructuredOutputs

    model_dir, prompts, ref = target
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constrained = [
        SamplingParams(
            max_tokens=24, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(json=schema)
        )
        for s in range(2)
    ]
    params = [SamplingParams(max_tokens=20, temperature=0.0)] * len(prompts) + constrained
    every = prompts + prompts[:2]
    spec = LLM(str(model_dir), device="cpu", overlap=overlap, speculative_config=_spec(model_dir))
    plain = LLM(str(model_dir), device="cpu", overlap=overlap)
    got = spec.generate(every, params, use_tqdm=False)
    want = plain.generate(every, params, use_tqdm=False)
    assert [o.token_ids for o in got[: len(prompts)]] == ref
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "stop" for o in got[len(prompts) :])
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    spec.shutdown()
    plain.shutdown()


def test_a_row_whose_request_ended_before_it_was_processed_counts_no_drafts(target) -> None:  # type: ignore[no-untyped-def]
    """In the overlap loop a draft model drafts without waiting for the host, so a request whose first
    token stops it already has a drafted row in flight; that row's tokens are dropped, and its drafts
    stay out of the counters (vLLM counts the drafts of running requests only)."""
    model_dir, prompts, ref = target
    llm = LLM(str(model_dir), device="cpu", overlap=True, speculative_config=_spec(model_dir))
    params = [SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[r[0]]) for r in ref]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r[:1] for r in ref]
    stats = llm.stats()
    assert stats["kv_pages_used"] == 0
    assert stats["spec_decode_num_drafts"] == stats["spec_decode_num_draft_tokens"] == 0
    # A request that runs on counts as before, in the same engine.
    assert [
        o.token_ids
        for o in llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    ] == [ref[0][:8]]
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    llm.shutdown()


def test_a_draft_with_a_shorter_context_is_refused_unless_max_model_len_fits_it(  # type: ignore[no-untyped-def]
    target, tiny_model_dir
) -> None:
    """The draft runs at every position the target does: past its own `max_position_embeddings` its
    rotary table (CUDA) has no row, so start-up names the field and the way out."""
    model_dir, prompts, ref = target
    short = tiny_model_dir("qwen3", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"speculative_config\.model .*max_position_embeddings \(64\)"):
        LLM(str(model_dir), device="cpu", speculative_config=_spec(short))
    llm = LLM(str(model_dir), device="cpu", max_model_len=64, speculative_config=_spec(short))
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    llm.shutdown()
