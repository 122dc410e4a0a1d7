"""The per-request switch: `SamplingParams(speculative=False)` (the `speculative: false` body field) keeps
a request's rows plain while the others in the same batches draft; output stays HF's greedy either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.deploy.protocol.job_builder import chat_job, completion_job
from tandem.deploy.protocol.requests import ChatCompletionRequest, CompletionRequest
from tandem.engine.tiny import default_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def recited() -> tuple[Path, list[list[int]], list[list[int]]]:
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    passage = tok((model_dir.parent / "corpus.txt").read_text()[:300])["input_ids"]
    prompts = [passage + passage[:12], passage[:60] + passage[:10]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    return model_dir, prompts, ref


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_can_turn_speculation_off(recited, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, ref = recited
    llm = LLM(str(model_dir), device="cpu", overlap=overlap, speculative_config=NGRAM)
    off = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    on = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, off, use_tqdm=False)] == ref
    assert llm.stats()["spec_decode_num_drafts"] == 0  # the recited prompts would have drafted
    assert [o.token_ids for o in llm.generate(prompts, [off, on], use_tqdm=False)] == ref
    mixed = llm.stats()
    assert mixed["spec_decode_num_drafts"] > 0
    # Only the second request drafted: its drafts are at most one per step of its 24 outputs.
    assert mixed["spec_decode_num_drafts"] <= 24
    assert [o.token_ids for o in llm.generate(prompts, on, use_tqdm=False)] == ref
    assert llm.stats()["spec_decode_num_drafts"] > mixed["spec_decode_num_drafts"]
    llm.shutdown()


def test_the_body_field_reaches_sampling_params() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert chat_job(ChatCompletionRequest.model_validate(chat), "c", 0.0).sampling.speculative
    off = chat_job(ChatCompletionRequest.model_validate({**chat, "speculative": False}), "c", 0.0)
    assert off.sampling.speculative is False
    done = completion_job(CompletionRequest.model_validate({"prompt": "x", "speculative": False}), "c", 0.0)
    assert done.sampling.speculative is False
    with pytest.raises(ValueError, match="speculative"):
        CompletionRequest.model_validate({"prompt": "x", "speculative": "maybe"})
    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative=1).validate()  # type: ignore[arg-type]


def test_overlap_cadence_of_drafted_and_plain_rows_in_one_batch(recited) -> None:  # type: ignore[no-untyped-def]
    """The loop as built (docs/architecture.md, speculative decoding): a plain row is in every batch; a
    request whose drafted row is in batch N sits out N + 1 only (its accept count reaches the host when N
    is processed) and is back in N + 2, never later."""
    model_dir, prompts, ref = recited
    draft = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    llm = LLM(str(model_dir), device="cpu", speculative_config=draft)
    builder = llm.runtime.scheduler.builder
    build = builder.build
    batches: list[dict[int, int]] = []  # per batch: rid -> drafts in its row

    def spy(batch_id: int, rows: list[Any]) -> Any:
        batches.append({row.req.rid: len(row.drafts) for row in rows})
        return build(batch_id, rows)

    builder.build = spy  # type: ignore[method-assign]
    off = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    on = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, [off, on], use_tqdm=False)
    llm.shutdown()
    assert [o.token_ids for o in outs] == ref
    plain_rid, drafted_rid = sorted({rid for b in batches for rid in b})  # admitted in prompt order
    in_plain = [i for i, b in enumerate(batches) if plain_rid in b]
    assert in_plain == list(range(in_plain[0], in_plain[-1] + 1))  # every step, never skipped
    assert all(batches[i][plain_rid] == 0 for i in in_plain)
    drafted_at = [i for i, b in enumerate(batches) if b.get(drafted_rid, 0) > 0]
    assert drafted_at, "the draft model drafts for the request that kept speculation on"
    for i in drafted_at[:-1]:
        assert drafted_rid not in batches[i + 1] and drafted_rid in batches[i + 2], (i, batches)
