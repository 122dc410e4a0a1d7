"""`echo` on /v1/completions, in the request shapes lm-eval's `local-completions` model sends for its
loglikelihood and multiple-choice tasks: the prompt's tokens come back first, with their logprobs (the
first null), then the generated ones, as OpenAI's legacy completions and vLLM return them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tandem.deploy.serving.http import build_http_app

from ..fakes import MODEL, MakeService


def _post(service: Any, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_http_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(go())


def _loglikelihood(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs reads from a choice."""
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))


def test_lm_eval_loglikelihood_request_on_token_ids(make_service: MakeService) -> None:
    service, replica = make_service()
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    # lm-eval's payload for loglikelihood requests, tokenized (its default), as it sends it.
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}  # fmt: skip
    response = _post(service, body)
    assert response.status_code == 200, response.text
    out = response.json()
    for choice, prompt in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
        logprobs = choice["logprobs"]
        # The prompt's tokens, then the one generated token.
        assert len(logprobs["tokens"]) == len(prompt) + 1 == len(logprobs["token_logprobs"])
        assert len(logprobs["top_logprobs"]) == len(prompt) + 1 == len(logprobs["text_offset"])
        assert logprobs["tokens"][: len(prompt)] == [replica.tokenizer.decode([t]) for t in prompt]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = [-k / 10 for k in range(1, len(prompt))]  # what the fake scores prompt token k
        assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected)
        assert logprobs["token_logprobs"][-1] == -0.5  # the generated token's
        for top in logprobs["top_logprobs"][1:]:
            assert 1 <= len(top) <= 2  # the top alternative, plus the token itself where it is not it
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        assert choice["text"].startswith(replica.tokenizer.decode(prompt))
        total, greedy = _loglikelihood(choice, 2)
        assert total == pytest.approx(sum(expected[1:]))
        assert greedy is False  # the fake's alternatives score higher than the prompt's tokens
    assert out["usage"]["completion_tokens"] == 2  # one generated token per choice


def test_echo_of_a_string_prompt_with_and_without_generation(make_service: MakeService) -> None:
    service, replica = make_service()
    prompt = "a b c"
    ids = replica.tokenizer.encode(prompt)
    scored = _post(service, {"prompt": prompt, "max_tokens": 0, "logprobs": 2, "echo": True}).json()
    (choice,) = scored["choices"]
    assert choice["text"] == prompt  # max_tokens 0: the prompt alone
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"][1:])
    assert scored["usage"]["completion_tokens"] == 0
    assert scored["usage"]["prompt_tokens"] == len(ids)

    plain = _post(service, {"prompt": prompt, "max_tokens": 3, "echo": True}).json()
    (choice,) = plain["choices"]
    assert choice["text"].startswith(prompt) and choice["text"][len(prompt) :].count("t") == 3
    assert choice["logprobs"] is None
    assert replica.prompts[-1] == ids

    refused = _post(service, {"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_echo_streams_the_prompt_first(make_service: MakeService) -> None:
    service, _ = make_service()
    response = _post(service, {"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 0, "echo": True,
                               "stream": True})  # fmt: skip
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][:3] == [None, pytest.approx(-0.1), pytest.approx(-0.2)]
    texts = "".join(c["choices"][0]["text"] for c in chunks)
    assert texts.count("t") >= 2 and len(chunks) >= 2
