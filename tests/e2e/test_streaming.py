"""Streaming over real HTTP on a Serve app with the default admission: streamed text equals the
non-streamed text under concurrency (multi-byte text included), an event carries about one token when
the client keeps up, and the replica admits what its engine runs at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

ENGINE_MAX_RUNNING = 6
PROMPTS = ["Héllo wörld, ", "日本語のテキスト ", "The fox 🦊 ran", "naïve café "]


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    # No max_ongoing_requests / max_queued_requests: both follow the engine's own capacity.
    args = {
        "model": str(tiny_model_dir("qwen3")),
        "served_model_name": "tiny-stream",
        "device": "cpu",
        "engine": {"page_size": 4, "max_running": ENGINE_MAX_RUNNING},
    }
    with serve_app_context(args) as running:
        yield running


async def _stream(session: aiohttp.ClientSession, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    async with session.post("/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


async def _whole(session: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post("/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return dict(await response.json())


def test_streamed_text_equals_the_whole_text_for_16_concurrent_requests(app: Any) -> None:
    # Seeded sampling is batch-invariant, so each request's tokens do not depend on what runs beside it;
    # at temperature 1 the 512-id byte-level vocabulary yields byte tokens that split characters.
    bodies = [
        {
            "model": app.served_model_name,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": 24,
            "temperature": 1.0 if i % 2 else 0.0,
            "seed": i,
            "ignore_eos": True,
        }
        for i in range(16)
    ]

    async def go() -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
        # 16 at a time: the replica admits 6 + 24 queued, and a 17th-plus would get its 503.
        async with aiohttp.ClientSession(app.base_url) as session:
            streams = await asyncio.gather(*(_stream(session, b) for b in bodies))
            wholes = await asyncio.gather(*(_whole(session, b) for b in bodies))
            return list(streams), list(wholes)

    streams, wholes = asyncio.run(go())
    texts = ["".join(c["text"] for e in events for c in e["choices"]) for events in streams]
    assert texts == [w["choices"][0]["text"] for w in wholes]
    # Multi-byte text came through (a random model may also emit bytes that are no valid UTF-8, which
    # decode to U+FFFD in both forms alike).
    assert any(any(127 < ord(ch) != 0xFFFD for ch in text) for text in texts)


def test_an_event_carries_about_one_token_at_concurrency_1(app: Any) -> None:
    body = {
        "model": app.served_model_name,
        "prompt": "Once upon a time",
        "max_tokens": 40,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,  # every event then lists its tokens, text or not
    }

    async def go() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(app.base_url) as session:
            return await _stream(session, body)

    events = [e for e in asyncio.run(go()) if e["choices"]]
    tokens = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events]
    assert sum(tokens) == 40
    assert sum(tokens) / len(events) <= 1.5, tokens  # one step per event while the client keeps up


def test_default_admission_follows_the_engine_capacity(app: Any) -> None:
    stats = app.handle.stats.remote().result(timeout_s=30)
    assert stats["max_ongoing_requests"] == ENGINE_MAX_RUNNING
    assert stats["max_queued_requests"] == 4 * ENGINE_MAX_RUNNING
