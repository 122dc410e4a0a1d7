"""Errors, overload, client disconnects, fuzzing and a dead rank on a real Ray Serve app (CPU).

The app is a TP=2 replica (two rank actors in the Serve placement group) with deliberately small limits
(8 running + 8 queued requests) so overload is cheap to reach.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import schemathesis
import schemathesis.core.jsonschema.patterns  # compiled here, not deep in a fixture's stack
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

MAX_ONGOING, MAX_QUEUED = 8, 8
CONTEXT = 2048  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    args = {
        "model": str(tiny_model_dir("qwen3")),
        "served_model_name": "tiny-errors",
        "tp_size": 2,  # so the Serve placement group path of a TP group is exercised too
        "device": "cpu",
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": MAX_QUEUED,
        # Small, so the fuzzed prompt lists and `n` reach the choices bound (a 400, never a 5xx).
        "max_choices_per_request": 4,
    }
    with serve_app_context(args, name="tandem-errors") as running:
        yield running


def post(app: Any, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{app.base_url}{path}", json=body, timeout=60, **kwargs)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop.0"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"model": "tiny-errors"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_invalid_parameters_are_400(
    app: Any, check_error: Callable[..., Any], path: str, body: Any, param: str
) -> None:
    response = post(app, path, body)
    assert response.status_code == 400, response.text
    error = check_error(response.json())
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_malformed_json_is_400(app: Any, check_error: Callable[..., Any]) -> None:
    for content in (b'{"prompt": "hi", ', b"not json", b""):
        response = httpx.post(
            f"{app.base_url}/v1/completions", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, (content, response.text)
        check_error(response.json())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1] * (CONTEXT + 1), "max_tokens": 1}, "prompt"),  # the prompt alone is too long
        ({"prompt": [1] * (CONTEXT + 1), "max_tokens": 100}, "prompt"),  # ... whatever max_tokens says
        ({"prompt": [1] * (CONTEXT - 10), "max_tokens": 11}, "max_tokens"),  # prompt + max_tokens is
        ({"prompt": "word " * 3000}, "prompt"),
    ],
)
def test_too_long_prompt_is_400(
    app: Any, check_error: Callable[..., Any], body: dict[str, Any], param: str
) -> None:
    response = post(app, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = check_error(response.json())
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)


def test_out_of_vocab_token_ids_are_400(app: Any, check_error: Callable[..., Any]) -> None:
    response = post(app, "/v1/completions", {"prompt": [1, 2, 10**6]})
    assert response.status_code == 400
    assert check_error(response.json())["param"] == "prompt"


def test_unknown_model_is_404(app: Any, check_error: Callable[..., Any]) -> None:
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404
    assert check_error(info.value.response.json())["code"] == "model_not_found"


def test_handle_errors_have_the_http_body(app: Any, check_error: Callable[..., Any]) -> None:
    bad = {"prompt": "hi", "temperature": -1}
    http = post(app, "/v1/completions", bad).json()
    assert app.handle.completions.remote(bad).result(timeout_s=30) == http
    unknown = {"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True}
    (only,) = list(app.handle.options(stream=True).chat_completions.remote(unknown))
    assert check_error(only)["code"] == "model_not_found"


def test_health_models_openapi(app: Any) -> None:
    assert httpx.get(f"{app.base_url}/health").status_code == 200
    models = httpx.get(f"{app.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-errors"]
    paths = httpx.get(f"{app.base_url}/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(paths)


async def _wait_idle(app: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    """Stats once no request runs or holds KV. The deadline is far shorter than the aborted requests
    would take to finish on their own (1900 tokens each), so only a real abort gets there in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await app.handle.stats.remote()
        idle = stats["kv_pages_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return dict(stats)
        await asyncio.sleep(0.2)


def test_overload_past_max_queued_is_503(app: Any, check_error: Callable[..., Any]) -> None:
    body = {"prompt": "overload", "max_tokens": 1900, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> tuple[int, Any]:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return response.status_code, await response.aread()
            # Admitted: read a chunk, then leave (the disconnect must abort it).
            async for _ in response.aiter_lines():
                break
            return 200, None

    async def run() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
            results = await asyncio.gather(*(one(client) for _ in range(4 * (MAX_ONGOING + MAX_QUEUED))))
            await _wait_idle(app)
            return results

    results = asyncio.run(run())
    statuses = [status for status, _ in results]
    assert statuses.count(200) >= MAX_ONGOING
    rejected = [payload for status, payload in results if status != 200]
    assert rejected, "nothing was turned away"
    assert {s for s in statuses if s != 200} <= {503, 429}
    for payload in rejected:
        assert check_error(json.loads(payload))["code"] == "overloaded"


def test_disconnects_free_kv(app: Any) -> None:
    async def stream_two_chunks(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"disconnect {i}", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break  # closing the response here is the client disconnect
        return seen

    async def run() -> tuple[list[int], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
            seen: list[int] = []
            for wave in range(5):  # 50 streams, 10 at a time (within running + queued capacity)
                seen += await asyncio.gather(*(stream_two_chunks(client, 10 * wave + i) for i in range(10)))
        return seen, await _wait_idle(app)

    seen, stats = asyncio.run(run())
    assert seen == [2] * 50
    assert stats["kv_pages_used"] == 0, stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


def test_handle_cancel_frees_kv(app: Any) -> None:
    async def run() -> tuple[int, dict[str, Any]]:
        body = {"prompt": "cancel me", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        streams = [app.handle.options(stream=True).completions.remote(body) for _ in range(6)]
        seen = 0
        for stream in streams:
            seen += len([await anext(stream), await anext(stream)])
            stream.cancel()
        return seen, await _wait_idle(app)

    seen, stats = asyncio.run(run())
    assert seen == 12
    assert stats["kv_pages_used"] == 0 and stats["num_running"] == 0, stats


# ---- fuzzing: no input may produce a 5xx ------------------------------------------------------------


@pytest.fixture(scope="module")
def api_schema(app: Any) -> Any:
    return schemathesis.openapi.from_url(f"{app.base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _bounded(body: Any, served: str) -> Any:
    """Keep generated requests cheap on 2 CPU cores, and aimed at the served model."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
            body[key] = 4
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("model"), str):
        body["model"] = served
    return body


@schema.parametrize()
@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_a_5xx(case: Any, app: Any) -> None:
    if isinstance(case.body, dict):
        case.body = _bounded(case.body, app.served_model_name)
    response = case.call(base_url=app.base_url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])


# ---- last, since it breaks the replica: a dead rank -------------------------------------------------


def _rank_pids() -> list[int]:
    """PIDs of this test's own rank actors: workers of this Ray session's raylet named RankWorker."""
    import ray

    raylet = ray._private.worker.global_worker.node.all_processes["raylet"][0].process.pid
    listing = subprocess.run(["ps", "-o", "pid=,cmd=", "--ppid", str(raylet)], capture_output=True, text=True)
    return [int(line.split()[0]) for line in listing.stdout.splitlines() if "RankWorker" in line]


def test_a_dead_rank_fails_requests_fast_and_health_says_503(
    app: Any, check_error: Callable[..., Any]
) -> None:
    ranks = _rank_pids()
    assert len(ranks) == 2
    rank = ranks[-1]  # not rank 0: its peer then blocks in a collective, and must still be noticed
    body = {"prompt": "doomed", "max_tokens": 1900, "ignore_eos": True}

    async def run() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
            pending = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await asyncio.sleep(1.0)
            os.kill(rank, signal.SIGKILL)
            killed = time.monotonic()
            response = await pending
            return response, time.monotonic() - killed

    response, seconds = asyncio.run(run())
    assert response.status_code == 503 and seconds < 15.0  # an error, not a hang
    assert check_error(response.json())["type"] == "server_error"
    deadline = time.monotonic() + 15.0
    while (health := httpx.get(f"{app.base_url}/health", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "health stayed 200 with a dead rank"
        time.sleep(0.5)
    assert health.status_code == 503 and check_error(health.json())["code"] == "unhealthy"
