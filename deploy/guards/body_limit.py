"""A cap on request bodies: past `max_bytes`, a 413 in OpenAI's shape before anything parses the body.

A body with a `Content-Length` over the cap is answered from its headers alone. A chunked body (no
length) is counted as it arrives; the middleware holds it until it ends, so the app never parses a body
that turns out too large. FastAPI reads a JSON body whole before parsing anyway, so holding it costs
nothing more.

After the 413 the rest of the body is read and dropped, for a bounded time and size (a "lingering
close"): a client such as httpx sends its whole body before it reads the answer, and a server that
closed the connection on unread data would make the kernel reset it, so the client would see a broken
connection instead of the 413.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.deploy.protocol.errors import OpenAIError

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DISCARD_S = 5.0  # how long a refused body is read and dropped, at most
DISCARD_BYTES = 256 * 2**20  # and how much of it


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (max_request_body_bytes)",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                await _reject(send, self.max_bytes)
                await _discard(receive)
                return
            await self.app(scope, receive, send)  # the server stops the body at its declared length
            return
        held: list[Message] = []
        total = 0
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: let the app see it
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await _reject(send, self.max_bytes)
                if message.get("more_body", False):
                    await _discard(receive)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reject(send: Send, limit: int) -> None:
    body = json.dumps(body_too_large(limit).body()).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _discard(receive: Receive) -> None:
    """Read and drop the rest of a refused body, until it ends or the time or size bound is reached."""
    deadline = time.monotonic() + DISCARD_S
    dropped = 0
    while dropped <= DISCARD_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))
