"""API keys, request bounds and the stuck-rank watchdog on a real Ray Serve app (CPU, TP=2 tiny model).

One app for the module, with an API key, a 1 MiB body limit and a 3 s stuck-rank timeout. The watchdog
test pauses a rank, which breaks the replica, so it runs last.
"""

from __future__ import annotations

import asyncio
import itertools
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

KEY = "sk-e2e-secret"
BODY_LIMIT = 1 << 20
STUCK_S = 3.0


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    args = {
        "model": str(tiny_model_dir("qwen3")),
        "served_model_name": "tiny-secure",
        "tp_size": 2,  # so a paused rank 1 leaves rank 0 stuck in a collective, with work
        "device": "cpu",
        "api_key": ["sk-other", KEY],
        "max_request_body_bytes": BODY_LIMIT,
        "stuck_rank_timeout_s": STUCK_S,
    }
    with serve_app_context(args, name="tandem-security") as running:
        yield running


AUTH = {"Authorization": f"Bearer {KEY}"}


def post(app: Any, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{app.base_url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": f"Token {KEY}"},
        {"Authorization": "Bearer"},
    ],
    ids=["missing", "wrong", "malformed", "empty"],
)
def test_v1_needs_the_key(app: Any, check_error: Callable[..., Any], headers: dict[str, str] | None) -> None:
    response = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers)
    assert response.status_code == 401, response.text
    assert check_error(response.json())["type"] == "authentication_error"
    models = httpx.get(f"{app.base_url}/v1/models", headers=headers, timeout=30)
    assert models.status_code == 401


def test_the_sdk_with_the_key_gets_200_and_health_stays_open(app: Any) -> None:
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=app.served_model_name, prompt="hello", max_tokens=3)
    assert out.usage is not None and out.usage.completion_tokens == 3
    stranger = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    health = httpx.get(f"{app.base_url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_a_20mb_body_is_413_at_once_while_a_stream_flows(
    app: Any, check_error: Callable[..., Any], reliability_figures: dict[str, Any]
) -> None:
    big = json.dumps({"prompt": "a" * (20 << 20), "max_tokens": 1}).encode()
    stream_body = {"prompt": "keep going", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def stream(client: httpx.AsyncClient, arrivals: list[float], started: asyncio.Event) -> None:
        async with client.stream("POST", "/v1/completions", json=stream_body, headers=AUTH) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5:
                        started.set()

    async def run() -> tuple[httpx.Response, float, list[float], float, float]:
        arrivals: list[float] = []
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
            streaming = asyncio.create_task(stream(client, arrivals, started))
            await started.wait()
            headers = {**AUTH, "content-type": "application/json"}
            sent = time.monotonic()
            response = await client.post("/v1/completions", content=big, headers=headers)
            answered = time.monotonic()
            await streaming
        return response, answered - sent, arrivals, sent, answered

    response, seconds, arrivals, sent, answered = asyncio.run(run())
    assert response.status_code == 413 and seconds < 1.0, (response.status_code, seconds)
    assert check_error(response.json())["code"] == "request_too_large"
    around = [t for t in arrivals if sent - 0.5 <= t <= answered + 0.5]
    gaps = [b - a for a, b in itertools.pairwise(around)]
    assert around and max(gaps, default=0.0) < 0.5, gaps
    reliability_figures["body_413"] = {"seconds": round(seconds, 3), "stream_max_gap_s": round(max(gaps), 3)}


def test_ten_thousand_prompts_times_128_is_400_at_once(
    app: Any, check_error: Callable[..., Any], ray_actors: Any
) -> None:
    body = {"prompt": ["hi there"] * 10_000, "n": 128, "max_tokens": 1}
    (replica_pid,) = ray_actors.alive("LLMServer").values()
    start = time.monotonic()
    response = post(app, "/v1/completions", body, AUTH)
    assert response.status_code == 400 and time.monotonic() - start < 1.0
    assert check_error(response.json())["param"] == "n"
    before = ray_actors.rss_mib(replica_pid)  # after the first: the parser's own one-time allocations
    for _ in range(5):
        assert post(app, "/v1/completions", body, AUTH).status_code == 400
    assert ray_actors.rss_mib(replica_pid) - before < 16.0  # 1.28M choices were never built


def test_clients_cannot_pick_the_chat_template(app: Any, check_error: Callable[..., Any]) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"chat_template": "{{ ''.__class__ }}"},
    }
    response = post(app, "/v1/chat/completions", body, AUTH)
    assert response.status_code == 400
    assert check_error(response.json())["param"] == "chat_template_kwargs"


# ---- last, since it breaks the replica: a paused rank ---------------------------------------------


def _rank_pids() -> list[int]:
    import ray

    raylet = ray._private.worker.global_worker.node.all_processes["raylet"][0].process.pid
    listing = subprocess.run(["ps", "-o", "pid=,cmd=", "--ppid", str(raylet)], capture_output=True, text=True)
    return [int(line.split()[0]) for line in listing.stdout.splitlines() if "RankWorker" in line]


def test_a_paused_rank_ends_requests_with_an_error_and_fails_health(
    app: Any, check_error: Callable[..., Any], reliability_figures: dict[str, Any]
) -> None:
    ranks = _rank_pids()
    assert len(ranks) == 2
    body = {"prompt": "paused", "max_tokens": 1900, "ignore_eos": True, "stream": True}

    async def run() -> tuple[list[dict[str, Any]], bool, float]:
        chunks: list[dict[str, Any]] = []
        done = False
        async with (
            httpx.AsyncClient(base_url=app.base_url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response,
        ):
            assert response.status_code == 200
            paused = 0.0
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[len("data: ") :]))
                    if len(chunks) == 3:
                        os.kill(ranks[-1], signal.SIGSTOP)
                        paused = time.monotonic()
            return chunks, done, time.monotonic() - paused

    try:
        chunks, done, seconds = asyncio.run(run())
        assert done and "error" in chunks[-1], chunks[-1]
        assert check_error(chunks[-1])["type"] == "server_error"
        assert seconds < STUCK_S + 8.0, seconds  # the timeout plus the health loop and heartbeat RPC
        deadline = time.monotonic() + 15.0
        while (health := httpx.get(f"{app.base_url}/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200 with a paused rank"
            time.sleep(0.5)
        error = check_error(health.json())
        assert error["code"] == "unhealthy" and error["message"].startswith("unhealthy: ")
        assert "rank 1" not in error["message"]  # details stay in the log
        reliability_figures["paused_rank"] = {
            "stuck_rank_timeout_s": STUCK_S,
            "error_after_s": round(seconds, 2),
            "health": error["message"],
        }
    finally:
        os.kill(ranks[-1], signal.SIGCONT)
