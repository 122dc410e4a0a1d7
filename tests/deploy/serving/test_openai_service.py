"""The OpenAI service and the LLMServer request path, in process, over a scripted replica.

No Ray here: `GenerationService` runs on `FakeReplica`, and `OpenAIService` talks to it through an
in-process backend, so protocol logic (usage, n, logprobs, SSE, errors, cancellation) is tested fast.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from tandem.deploy.generation.service import GenerationService
from tandem.deploy.observability.metrics import NullMetrics
from tandem.deploy.protocol.errors import OpenAIError, overloaded
from tandem.deploy.protocol.requests import ChatCompletionRequest, CompletionRequest
from tandem.deploy.serving.http import build_http_app
from tandem.deploy.serving.openai_service import OpenAIService

from ..fakes import MODEL, STEP_S, FakeReplica, MakeService


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def collect(stream: Any) -> list[dict[str, Any]]:
    """A service stream's chunks, its batches flattened."""
    return [chunk async for batch in stream for chunk in batch]


def test_completion_usage_logprobs_and_n(make_service: MakeService) -> None:
    service, replica = make_service()
    body = CompletionRequest(prompt=["a b", "c"], max_tokens=3, n=2, logprobs=2, seed=1)
    out = run(service.completions(body))
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    lengths = [len(replica.tokenizer.encode(p)) for p in ["a b", "c"]]
    prompt_tokens = sum(lengths)
    assert out["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
        # Once per prompt, as prompt_tokens counts it, not once per choice (n=2).
        "prompt_tokens_details": {"cached_tokens": sum(n // 2 for n in lengths)},
    }
    first = out["choices"][0]
    assert first["finish_reason"] == "length" and first["text"].count("t") == 3
    logprobs = first["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == 3
    assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    # n seeded choices of one prompt differ (distinct seeds), and repeat across calls.
    assert out["choices"][0]["text"] != out["choices"][1]["text"]
    assert run(service.completions(body))["choices"] == out["choices"]


def test_chat_stream_chunks_and_usage(make_service: MakeService) -> None:
    service, _ = make_service()
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    )  # fmt: skip
    chunks = run(collect(run_stream(service.chat_completions(request))))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 4  # one chunk per token: nothing is held back to batch
    assert all(len(c["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2 for c in content)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"] // 2}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(make_service: MakeService) -> None:
    """vLLM's `stream_options.continuous_usage_stats`, as its clients send it (supported, not ignored)."""
    service, _ = make_service()
    request = CompletionRequest.model_validate(
        {"prompt": "a b", "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )  # fmt: skip
    chunks = run(collect(run_stream(service.completions(request))))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [1, 2, 3, 3]  # three token chunks, then the usage chunk
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n for c, n in zip(chunks, counts))
    alone = CompletionRequest.model_validate(
        {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    )
    assert not alone.continuous_usage  # without include_usage it changes nothing, as in vLLM


def run_stream(coro: Any) -> Any:
    async def stream() -> AsyncGenerator[dict[str, Any], None]:
        async for chunk in await coro:
            yield chunk

    return stream()


def test_chat_default_max_tokens_fills_the_context(make_service: MakeService) -> None:
    service, replica = make_service()
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    out = run(service.chat_completions(request))
    prompt = out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == replica.max_model_len - prompt
    rendered = replica.tokenizer.decode(replica.prompts[-1])
    assert rendered.startswith("<|im_start|>user\nhi") and rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        # The prompt alone is too long: it is at fault, whatever max_tokens says.
        ({"prompt": "a " * 70, "max_tokens": 1}, "context_length_exceeded", "prompt"),
        ({"prompt": "a " * 70, "max_tokens": 50}, "context_length_exceeded", "prompt"),
        ({"prompt": ["a", "a " * 70], "max_tokens": 1}, "context_length_exceeded", "prompt.1"),
        ({"prompt": list(range(1, 65)), "max_tokens": 1}, "context_length_exceeded", "prompt"),
        # The prompt fits; with max_tokens it does not.
        ({"prompt": "a", "max_tokens": 64}, "context_length_exceeded", "max_tokens"),
        ({"prompt": [1, 2, 10_000]}, "invalid_value", "prompt"),
        ({"prompt": ""}, "invalid_value", "prompt"),
        ({"prompt": [1, 13]}, "invalid_value", None),  # the replica's own validation
    ],
)
def test_rejections_are_400_before_any_generation(
    body: dict[str, Any], code: str, param: str | None, make_service: MakeService
) -> None:
    service, replica = make_service()
    with pytest.raises(OpenAIError) as info:
        run(service.completions(CompletionRequest.model_validate(body)))
    assert info.value.status == 400 and (info.value.code, info.value.param) == (code, param)
    assert replica.prompts == []  # nothing reached the replica


def test_a_chat_too_long_by_itself_names_messages(make_service: MakeService) -> None:
    service, _ = make_service()
    body = {"messages": [{"role": "user", "content": "a " * 70}], "max_tokens": 1}
    with pytest.raises(OpenAIError) as info:
        run(service.chat_completions(ChatCompletionRequest.model_validate(body)))
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")


def test_unknown_model_and_backpressure(make_service: MakeService) -> None:
    service, _ = make_service()
    with pytest.raises(OpenAIError) as info:
        run(service.completions(CompletionRequest(prompt="x", model="other")))
    assert info.value.status == 404 and info.value.code == "model_not_found"
    busy, _ = make_service(fail_with=overloaded("full"))
    with pytest.raises(OpenAIError) as info:
        run(busy.completions(CompletionRequest(prompt="x", stream=True)))
    assert info.value.status == 503

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_http_app(busy))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json={"prompt": "x"})

    response = run(post())
    assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
    assert response.headers["retry-after"] == "1"  # what the OpenAI SDK waits before its retry


def test_replica_failure_is_503_or_a_final_error_chunk(make_service: MakeService) -> None:
    service, _ = make_service(FakeReplica(failure="rank 1 died"))
    with pytest.raises(OpenAIError) as info:
        run(service.completions(CompletionRequest(prompt="x", max_tokens=4)))
    assert info.value.status == 503 and "rank 1 died" in info.value.message
    chunks = run(
        collect(run_stream(service.completions(CompletionRequest(prompt="x", max_tokens=4, stream=True))))
    )
    assert "rank 1 died" in chunks[-1]["error"]["message"]


@pytest.mark.parametrize("n", [1, 3])
def test_closing_a_stream_aborts_every_choice(n: int, make_service: MakeService) -> None:
    service, replica = make_service()

    async def go() -> None:
        stream = await service.completions(CompletionRequest(prompt="x", max_tokens=50, n=n, stream=True))
        got = [await anext(stream), await anext(stream)]
        assert len(got) == 2
        await stream.aclose()

    run(go())
    assert replica.active == set()
    assert len(replica.aborted) == n


@pytest.mark.parametrize("n", [1, 3])
def test_choices_reach_the_replica_before_the_stream_is_read(n: int, make_service: MakeService) -> None:
    """The request goes to the ranks when the service answers, not when the HTTP body is first read
    (after the headers), so prefill overlaps the response start; a stream closed unread still aborts."""
    service, replica = make_service()

    async def go() -> None:
        stream = await service.completions(CompletionRequest(prompt="x", max_tokens=50, n=n, stream=True))
        assert len(replica.prompts) == n and len(replica.active) == n  # nothing read from the stream yet
        await stream.aclose()
        await asyncio.sleep(0)
        # Aborted by the close itself, not later by the loop's generator finalizers.
        assert replica.active == set() and len(replica.aborted) == n

    run(go())


def test_stats_and_health_aggregate_replicas(make_service: MakeService) -> None:
    per_replica = {"kv_pages_used": 1, "num_running": 2, "kv_pages_used_per_group": [1]}
    service, _ = make_service(stats=[per_replica] * 2, health=[None, "rank 1 is dead"])
    stats = run(service.stats())
    assert stats == {"kv_pages_used": 2, "num_running": 4, "kv_pages_used_per_group": [2], "num_replicas": 2}
    assert run(service.health()) == "rank 1 is dead"
    assert service.models()["data"][0]["id"] == MODEL


def test_http_routes_errors_and_sse(make_service: MakeService) -> None:
    service, _ = make_service(health=[None, "rank 1 is dead"])
    transport = httpx.ASGITransport(app=build_http_app(service))

    chat = {"model": "x", "messages": [{"role": "user", "content": "x"}]}
    json_header = {"content-type": "application/json"}

    async def go() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return {
                "bad_json": await client.post("/v1/completions", content=b"{", headers=json_header),
                "invalid": await client.post("/v1/completions", json={"prompt": "x", "top_p": 2}),
                "unknown": await client.post("/v1/chat/completions", json=chat),
                "misspelt": await client.post(
                    "/v1/chat/completions", json={**chat, "model": MODEL, "max_token": 5, "temprature": 0}
                ),
                "no_route": await client.get("/v2/nothing"),
                "health": await client.get("/health"),
                "sse": await client.post(
                    "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}
                ),
                "openapi": await client.get("/openapi.json"),
            }

    responses = run(go())
    for name, status in [
        ("bad_json", 400),
        ("invalid", 400),
        ("unknown", 404),
        ("misspelt", 400),
        ("no_route", 404),
        ("health", 503),
    ]:
        response = responses[name]
        assert response.status_code == status, (name, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert responses["invalid"].json()["error"]["param"] == "top_p"
    misspelt = responses["misspelt"].json()["error"]
    assert misspelt["message"] == "Unrecognized request arguments supplied: max_token, temprature"
    sse = responses["sse"]
    assert sse.headers["x-accel-buffering"] == "no" and sse.headers["content-type"].startswith(
        "text/event-stream"
    )
    events = [e for e in sse.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    assert json.loads(events[0].removeprefix("data: "))["object"] == "text_completion"
    assert "/v1/chat/completions" in responses["openapi"].json()["paths"]


def test_the_admission_slot_is_freed_when_the_last_token_arrives_not_when_it_is_read() -> None:
    """A slow client must not hold the engine's batch: its slot goes back once the engine is done."""
    from tandem.deploy.generation.backend import ReplicaBackend
    from tandem.deploy.guards.admission import Admission

    replica = FakeReplica()
    admission = Admission(max_running=1, max_queued=4)
    service = OpenAIService(ReplicaBackend(GenerationService(replica, NullMetrics()), admission), MODEL)

    async def go() -> list[dict[str, Any]]:
        stream = await service.completions(CompletionRequest(prompt="x", max_tokens=5, stream=True))
        assert admission.running == 1
        for _ in range(200):  # the fake engine finishes its 5 steps; nobody reads the stream
            if admission.running == 0:
                break
            await asyncio.sleep(STEP_S)
        assert admission.running == 0
        chunks = await collect(stream)  # everything is still there for the late reader
        return chunks

    chunks = run(go())
    assert "".join(c["choices"][0]["text"] for c in chunks).count("t") == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


class Outcomes:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def request_outcome(self, outcome: str) -> None:
        self.seen.append(outcome)


def test_each_generate_request_records_one_outcome(make_service: MakeService) -> None:
    outcomes = Outcomes()
    service, _ = make_service(outcomes=outcomes)
    transport = httpx.ASGITransport(app=build_http_app(service))

    async def go() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})  # ok
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})  # ok
            await client.post("/v1/completions", json={"prompt": "x", "top_p": 2})  # 4xx, by FastAPI
            await client.post("/v1/completions", json={"prompt": "a " * 70, "max_tokens": 1})  # 4xx
            await client.post("/v1/completions", json={"prompt": "x", "model": "other"})  # 4xx
            await client.get("/v1/models")  # not a generate request

    run(go())
    assert outcomes.seen == ["ok", "ok", "4xx", "4xx", "4xx"]
    busy, _ = make_service(fail_with=overloaded("full"), outcomes=outcomes)
    with pytest.raises(OpenAIError):
        run(busy.completions(CompletionRequest(prompt="x")))
    failing, _ = make_service(FakeReplica(failure="rank died"), outcomes=outcomes)
    run(collect(run_stream(failing.completions(CompletionRequest(prompt="x", max_tokens=4, stream=True)))))

    async def client_leaves() -> None:
        stream = await service.completions(CompletionRequest(prompt="x", max_tokens=50, stream=True))
        await anext(stream)
        await stream.aclose()

    run(client_leaves())
    # A dead rank mid-stream is the 503 its error chunk says, not an internal error.
    assert outcomes.seen[5:] == ["503", "503", "aborted"]
