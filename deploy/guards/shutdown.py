"""Draining on SIGTERM: stop taking requests, let running ones finish for a grace period, end the rest
with an error event, then let the caller stop Ray.

Two halves. In each replica, `DrainGate` is the outermost ASGI middleware of the app: it counts the
`/v1/*` requests in flight (a stream counts until its last byte is sent) and, once closed, answers new
ones with an OpenAI-shaped 503 and `/health` with `unhealthy: draining`, so a load balancer stops
sending. In `tandem serve`, `drain_app` drives the replicas through their handle methods
(`begin_drain`, `in_flight`, `end_drain`). It only runs when `tandem serve` started Ray itself: on a
joined cluster the app outlives the command.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from types import FrameType
from typing import Any, TextIO

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.deploy.protocol.errors import OpenAIError

DEFAULT_DRAIN_GRACE_S = 30.0
CONTROL_TIMEOUT_S = 10.0
POLL_S = 0.2


class TerminateRequested(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: a KeyboardInterrupt, so the same clean-up runs as for Ctrl-C,
    but told apart from it to drain first (Ctrl-C in a terminal also reaches Ray's own processes)."""


def raise_terminate(signum: int, frame: FrameType | None) -> None:
    raise TerminateRequested


def shutting_down() -> OpenAIError:
    return OpenAIError(
        503,
        "the server is shutting down; retry on another replica",
        type="server_error",
        code="shutting_down",
    )


class DrainGate:
    """Counts the app's requests in flight and, once closed, turns new ones away."""

    def __init__(self, app: ASGIApp, state: GateState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if self.state.closed and (path.endswith("/health") or "/v1/" in path):
            error = shutting_down()
            if path.endswith("/health"):
                error = OpenAIError(503, "unhealthy: draining", type="server_error", code="unhealthy")
            await _send_error(send, error)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
            if self.state.in_flight == 0:
                self.state.idle.set()


class GateState:
    """Shared by the gate middleware and the replica's drain handle methods."""

    def __init__(self) -> None:
        self.closed = False
        self.in_flight = 0
        self.idle = asyncio.Event()

    def close(self) -> None:
        self.closed = True
        if self.in_flight == 0:
            self.idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        if self.in_flight == 0:
            return True
        self.idle.clear()
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return False
        return True


async def _send_error(send: Send, error: OpenAIError) -> None:
    body = json.dumps(error.body()).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii"))]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def drain_app(app_name: str, grace_s: float, out: TextIO = sys.stderr) -> None:
    """Close every replica, wait up to `grace_s` for their requests to finish, then end the rest.

    Best effort: a replica that does not answer is left to the Ray shutdown that follows."""
    from ray import serve

    try:
        handle = serve.get_app_handle(app_name)
        _broadcast(handle, "begin_drain")
    except Exception as exc:  # no app (it never deployed) or no replica: nothing to drain
        print(f"tandem: nothing to drain ({type(exc).__name__})", file=out, flush=True)
        return
    deadline = time.monotonic() + grace_s
    remaining = _in_flight(handle)
    if remaining:
        print(f"tandem: draining {remaining} requests (up to {grace_s:g}s)", file=out, flush=True)
    while remaining and time.monotonic() < deadline:
        time.sleep(POLL_S)
        remaining = _in_flight(handle)
    if remaining:
        print(f"tandem: ending {remaining} unfinished requests with an error", file=out, flush=True)
    _broadcast(handle, "end_drain")


def _broadcast(handle: Any, method: str) -> list[Any]:
    return list(handle.broadcast(method).results(timeout_s=CONTROL_TIMEOUT_S + 5.0, return_exceptions=True))


def _in_flight(handle: Any) -> int:
    return sum(n for n in _broadcast(handle, "in_flight") if isinstance(n, int))
