"""Streamed responses over raw ASGI when the client goes away or the request is cancelled from
outside: the request is aborted at the replica, and only the response's own cancel is absorbed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tandem.deploy.serving.http import build_http_app

from ..fakes import MakeService


def _sse_request(app: Any, cancel_after_first: bool) -> tuple[list[bytes], BaseException | None]:
    """One streamed completion straight over ASGI, as uvicorn (ASGI spec 2.3) hands it to the app.

    After the first chunk, the client either disconnects (`http.disconnect`) or the request's task is
    cancelled from outside (as Serve does when it gives up on a request). Returns the body parts sent
    and what the app call raised."""
    payload = json.dumps({"prompt": "x", "max_tokens": 50, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    parts: list[bytes] = []

    async def go() -> BaseException | None:
        first_chunk = asyncio.Event()
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await first_chunk.wait()
            if cancel_after_first:
                await asyncio.Event().wait()  # the client stays; someone else cancels
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                parts.append(message["body"])
                first_chunk.set()

        task = asyncio.create_task(app(scope, receive, send))
        if cancel_after_first:
            await first_chunk.wait()
            task.cancel()
        try:
            await task
        except BaseException as exc:
            return exc
        return None

    return parts, asyncio.run(go())


def test_sse_disconnect_ends_the_response_quietly_and_aborts_the_request(make_service: MakeService) -> None:
    service, replica = make_service()
    parts, raised = _sse_request(build_http_app(service), cancel_after_first=False)
    assert raised is None  # nobody is left to answer: the disconnect is absorbed
    assert 1 <= len(parts) < 50 and b"[DONE]" not in b"".join(parts)
    assert replica.aborted and not replica.active


def test_sse_cancelled_from_outside_stays_cancelled_and_aborts_the_request(make_service: MakeService) -> None:
    service, replica = make_service()
    parts, raised = _sse_request(build_http_app(service), cancel_after_first=True)
    assert isinstance(raised, asyncio.CancelledError)  # only the response's own cancel is absorbed
    assert 1 <= len(parts) < 50
    assert replica.aborted and not replica.active
