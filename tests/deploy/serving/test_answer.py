"""`OpenAIService.answer` (the handle API's and batch files' way in) gives a body the HTTP route's answer:
the same status and body, errors included, for valid and invalid bodies alike."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tandem.deploy.protocol.errors import OpenAIError
from tandem.deploy.serving.http import build_http_app

from ..fakes import MODEL, MakeService

BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 3, "n": 2, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 500}),  # past the fake's context
    ("/v1/completions", {"model": "other", "prompt": "x"}),
    ("/v1/completions", {"prompt": [3, 13]}),  # the replica's own check refuses it
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"max_tokens": 2}),
    ("/v1/completions", [1, 2]),
]


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_answer_is_the_http_routes_answer(make_service: MakeService, path: str, body: Any) -> None:
    service, _ = make_service()

    async def both() -> tuple[tuple[int, Any], tuple[int, Any]]:
        try:
            answered: tuple[int, Any] = (200, await service.answer(path, body))
        except OpenAIError as error:
            answered = (error.status, error.body())
        transport = httpx.ASGITransport(app=build_http_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post(path, json=body)
        return answered, (response.status_code, response.json())

    (status, answer), (http_status, http_body) = asyncio.run(both())
    assert status == http_status
    assert without_ids(answer) == without_ids(http_body)


def test_streams_can_be_refused_and_unknown_routes_are_400s(make_service: MakeService) -> None:
    service, _ = make_service()
    body = {"prompt": "x", "stream": True}
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(service.answer("/v1/completions", body, allow_stream=False))
    assert (refused.value.status, refused.value.param) == (400, "stream")
    with pytest.raises(OpenAIError) as unknown:
        asyncio.run(service.answer("/v1/embeddings", body))
    assert (unknown.value.status, unknown.value.param) == (400, "url")
