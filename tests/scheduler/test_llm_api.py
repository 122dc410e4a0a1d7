"""The offline API's edges: bad input, stops, aborts, seeds and logprobs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.scheduler.messages import AbortRequest, AddRequest, SamplingSpec, SchedulerMsg, TokenOutput


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(tiny_model_dir("qwen3")), device="cpu", page_size=4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
    ],
)
def test_invalid_parameter_names_the_field(llm: LLM, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate(["hello"], SamplingParams(**{field: value}), use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0


def test_too_long_prompt_is_rejected_before_anything_runs(llm: LLM) -> None:
    limit = llm.limits.max_seq_len
    ok = [1, 2, 3]
    with pytest.raises(ValueError, match="context length"):
        llm.generate([ok, [5] * (limit - 4)], SamplingParams(max_tokens=8), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0


def test_bad_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[llm.vocab_size + 5]], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    prompt = [[7, 8, 9, 10]]
    free = llm.generate(
        prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    stopped = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_stop_string_truncates_text(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.generate(["The quick brown fox"], sp, use_tqdm=False)[0]
    assert len(free.text) > 6
    stop = free.text[3:6]  # very likely spans token boundaries
    out = llm.generate(
        ["The quick brown fox"], SamplingParams(**{**sp.__dict__, "stop": [stop]}), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    assert stop not in out.text
    assert llm.stats()["kv_pages_used"] == 0


def test_seeded_sampling_is_batch_invariant(llm: LLM) -> None:
    target = [11, 12, 13, 14, 15]
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([target], sp, use_tqdm=False)[0].token_ids
    others = [[20 + i, 30 + i, 40] for i in range(5)]
    mixed = llm.generate(
        others[:2] + [target] + others[2:],
        [SamplingParams(max_tokens=9, temperature=0.7)] * 2 + [sp] + [SamplingParams(max_tokens=5)] * 3,
        use_tqdm=False,
    )
    assert mixed[2].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(**{**sp.__dict__, "seed": 99}), use_tqdm=False)[0]
    assert other_seed.token_ids != alone


def test_logprobs(llm: LLM) -> None:
    out = llm.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3), use_tqdm=False
    )[0]
    assert len(out.logprobs) == 4 and len(out.top_logprobs) == 4
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3
        assert top[0][0] == token  # greedy picks the most likely token
        assert abs(top[0][1] - lp) < 1e-6
        assert top[0][1] >= top[1][1] >= top[2][1]
        assert lp <= 0.0


def test_abort_queued_and_running(llm: LLM) -> None:
    runtime = llm.runtime
    outputs: list[TokenOutput] = []
    runtime.scheduler.results.emit = outputs.extend
    try:
        spec = SamplingSpec(max_tokens=50, temperature=0.0, ignore_eos=True)
        inbox: list[SchedulerMsg] = [AddRequest(1000 + i, [5, 6, 7, 8 + i], spec) for i in range(3)]

        def receive(blocking: bool) -> list[SchedulerMsg]:
            msgs = list(inbox)
            inbox.clear()
            return msgs

        for _ in range(3):
            runtime.step(receive)
        inbox.extend([AbortRequest(1000), AbortRequest(1002)])
        runtime.step(receive)
        while runtime.busy:
            runtime.step(receive)
        reasons = {o.rid: o.finish_reason for o in outputs if o.finish_reason}
        assert reasons == {1000: "abort", 1001: "length", 1002: "abort"}
        assert llm.stats()["kv_pages_used"] == 0
    finally:
        runtime.scheduler.results.emit = llm._outputs.extend


def test_abort_while_waiting(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_running=1)
    outputs: list[TokenOutput] = []
    llm.runtime.scheduler.results.emit = outputs.extend
    spec = SamplingSpec(max_tokens=10, temperature=0.0, ignore_eos=True)
    inbox: list[SchedulerMsg] = [AddRequest(1, [5, 6], spec), AddRequest(2, [7, 8], spec)]
    llm.runtime.step(lambda blocking: [inbox.pop(0), inbox.pop(0)])
    assert llm.stats()["num_waiting"] == 1
    llm.runtime.step(lambda blocking: [AbortRequest(2)])
    while llm.runtime.busy:
        llm.runtime.step(lambda blocking: [])
    assert [o.finish_reason for o in outputs if o.rid == 2] == ["abort"]
    assert len([o for o in outputs if o.rid == 1 and o.token_id is not None]) == 10
    assert torch.tensor(llm.stats()["kv_pages_used"]).item() == 0
