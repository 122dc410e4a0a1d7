"""OpenAI-shaped errors for what only the Serve proxy sees: a replica that dies, or no replica at all.

With one Serve hop, the proxy holds the client's connection. When the LLMServer replica dies mid-request
the proxy ends the response without a word (a stream cut before `data: [DONE]`, or an empty 500), and
while no replica runs it answers in plain text. This ASGI middleware, installed in the proxy through
Ray's `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (see `PROXY_CALLBACK_ENV`), turns those into the
errors the OpenAI routes promise: a 503 JSON body, or a last `data: {"error": ...}` chunk then
`data: [DONE]`. It only watches the app's own routes, and passes every other message through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import msgspec
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.deploy.protocol.errors import OpenAIError

# The env var Ray's proxy reads at start-up; it must be set where the Ray nodes start (see `tandem serve`,
# the Helm chart and docs/serve-config.md), since the proxy is not part of any application.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "tandem.deploy.routing.proxy_errors:proxy_middlewares"
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
# While no replica runs (one died and Serve is replacing it), the proxy holds requests until a new one
# serves. A health probe must not hang that long: past this, /health answers 503 itself, within a second.
HEALTH_DEADLINE_S = 0.6
# Until a replica has answered through this proxy (the app is deploying, the model loading), /health
# answers at once that it is loading: a probe learns within a second of the port being bound.
LOADING_DEADLINE_S = 0.5
LOADING_MESSAGE = "loading: the model server is starting (no replica is ready yet)"
_encode = msgspec.json.Encoder().encode
logger = logging.getLogger(__name__)


def proxy_middlewares() -> list[Middleware]:
    """The callback Ray's proxy calls (by import path) for the middlewares it wraps its ASGI app in."""
    return [Middleware(ShapedProxyErrors)]


def _failure(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="service_unavailable")


def no_replica_error() -> OpenAIError:
    message = (
        f"unhealthy: no replica answered the health check within {HEALTH_DEADLINE_S:g}s "
        "(one may be restarting)"
    )
    return OpenAIError(503, message, type="server_error", code="unhealthy", retry_after_s=1)


def loading_error() -> OpenAIError:
    return OpenAIError(503, LOADING_MESSAGE, type="server_error", code="loading", retry_after_s=1)


class ShapedProxyErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.replica_answered = False  # this proxy has relayed a replica's /health answer
        self._probe: asyncio.Future[None] | None = None  # a loading-time probe left running

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).endswith(_ROUTES):
            await self.app(scope, receive, send)
            return
        started = finished = streaming = False
        # The id Serve gave the request (its response's x-request-id), else the client's, else one of
        # ours: what a client quotes to find the failure in the server log.
        request_id = _header(scope.get("headers") or [], b"x-request-id") or uuid.uuid4().hex
        held: list[Message] = []  # a plain-text 5xx of the proxy's own, replaced by the shaped one
        plain_text_error = False
        health = str(scope["path"]).endswith("/health")

        async def relay(message: Message) -> None:
            nonlocal started, finished, streaming, plain_text_error, request_id
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                request_id = headers.get(b"x-request-id", b"").decode("latin-1") or request_id
                content_type = headers.get(b"content-type", b"")
                json_body = content_type.startswith(b"application/json")
                if message["status"] >= 500 and not json_body:
                    plain_text_error = True
                    held.append(message)
                    return
                if health and message["status"] == 404 and not json_body:
                    # The proxy knows no route yet: the app is still being deployed.
                    await _send_json(send, loading_error())
                    finished = started = True
                    plain_text_error = True  # swallow the proxy's own body
                    held.append(message)
                    return
                if health and json_body:
                    self.replica_answered = True
                started = True
                streaming = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                if plain_text_error:
                    held.append(message)
                    if finished:
                        return
                    if not message.get("more_body", False):
                        text = b"".join(m.get("body", b"") for m in held[1:]).decode("utf-8", "replace")
                        await _send_json(send, _failure(f"no model server could take the request: {text}"))
                        finished = started = True
                    return
                finished = not message.get("more_body", False)
            await send(message)

        try:
            if health:
                started = await self._health_within_deadline(scope, receive, relay, send)
            else:
                await self.app(scope, receive, relay)  # no task per request on the generation routes
        finally:
            # The proxy returned (or raised) without finishing the response: the replica failed.
            with contextlib.suppress(Exception):  # the client may be gone too
                if not started or (streaming and not finished):
                    logger.warning(
                        "request %s to %s ended unanswered: its replica failed, or its client left",
                        request_id,
                        scope["path"],
                    )
                where = f"; the server log has the details under request id {request_id}"
                if not started:
                    await _send_json(send, _failure(f"the model server failed before answering{where}"))
                elif streaming and not finished:
                    error = _failure(f"the model server replica died while serving this request{where}")
                    tail = b"data: " + _encode(error.body()) + b"\n\ndata: [DONE]\n\n"
                    await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _health_within_deadline(self, scope: Scope, receive: Receive, relay: Send, send: Send) -> bool:
        """Run a /health request; True if it answered, or was answered here with a 503 at the deadline.

        A probe that misses its deadline (the model is loading, or a replica died and Serve is starting
        another) is left to run rather than cancelled: Serve's proxy logs a traceback for each request
        cancelled while it waits for a replica, and a probe every second would fill the log. Its answer,
        once a replica is up, is dropped, and while it is pending later probes are answered at once
        without another."""
        loading = not self.replica_answered
        if self._probe is not None and not self._probe.done():
            await _send_json(send, loading_error() if loading else no_replica_error())
            return True
        answered = asyncio.Event()
        abandoned = False

        async def watch(message: Message) -> None:
            if abandoned:
                if message["type"] == "http.response.start":
                    headers = dict(message.get("headers") or [])
                    self.replica_answered |= headers.get(b"content-type", b"").startswith(b"application/json")
                return
            answered.set()
            await relay(message)

        async def hold_after_abandon() -> Message:
            if abandoned:
                await asyncio.Event().wait()  # never: the client's connection is not the probe's now
            return await receive()

        call: asyncio.Future[None] | None = asyncio.ensure_future(self.app(scope, hold_after_abandon, watch))
        try:
            assert call is not None
            await asyncio.wait([call], timeout=LOADING_DEADLINE_S if loading else HEALTH_DEADLINE_S)
            if call.done() or answered.is_set():
                await call
                return answered.is_set()
            abandoned = True
            self._probe, call = call, None
            await _send_json(send, loading_error() if loading else no_replica_error())
            return True
        finally:
            if call is not None and not call.done():
                call.cancel()


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1") or None
    return None


async def _send_json(send: Send, error: OpenAIError) -> None:
    body = _encode(error.body())
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if error.retry_after_s is not None:
        headers.append((b"retry-after", str(error.retry_after_s).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
