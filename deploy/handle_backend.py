"""The ingress's `Backend`: the LLMServer deployment reached through a Serve `DeploymentHandle`.

Serve raises `BackPressureError` on the handle once `max_queued_requests` calls wait for a replica; it
becomes our 503 with the OpenAI body (Serve's own handler would answer in plain text). Closing a
`generate` stream cancels the LLMServer call, which aborts the request on the ranks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any, cast

from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tandem.deploy.errors import OpenAIError, internal_error, overloaded, unavailable
from tandem.deploy.jobs import GenerateJob, JobEvent

logger = logging.getLogger(__name__)

_HANDLE_ERRORS = (
    BackPressureError,
    DeploymentUnavailableError,
    RayActorError,
    RayTaskError,
    TaskCancelledError,
)

CONTROL_TIMEOUT_S = 10.0  # stats and health calls; a replica slower than this counts as unhealthy


def map_handle_error(exc: BaseException) -> OpenAIError:
    """The client-facing error for a failed LLMServer call."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, BackPressureError):
        return overloaded(f"the server is overloaded; retry later ({exc})")
    if isinstance(exc, DeploymentUnavailableError):
        return unavailable(f"no model server is available: {exc}")
    if isinstance(exc, TaskCancelledError):
        # Serve cancels the call when the client disconnects; nobody reads this answer.
        return unavailable("the request was cancelled")
    if isinstance(exc, RayActorError):
        return unavailable("the model server replica died while serving this request")
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, OpenAIError):
        return exc.cause
    logger.error("LLMServer call failed", exc_info=exc)
    return internal_error()


class HandleBackend:
    def __init__(self, handle: DeploymentHandle[Any]) -> None:
        self._stream = handle.options(stream=True)
        self._handle = handle

    async def generate(self, job: GenerateJob) -> AsyncGenerator[JobEvent, None]:
        response: Any = None
        try:
            response = cast(DeploymentResponseGenerator[JobEvent], self._stream.generate.remote(job))
            async for event in response:
                yield event
            response = None  # finished: nothing to cancel
        except _HANDLE_ERRORS as exc:
            # The call itself failed; cancelling it would only re-raise the failure.
            response = None
            raise map_handle_error(exc) from None
        finally:
            if response is not None:
                # The consumer left (client disconnect, handle cancel): stop the work on the replica,
                # which aborts the request on the ranks and frees its KV pages.
                with contextlib.suppress(Exception):
                    response.cancel()

    async def replica_stats(self) -> list[dict[str, Any]]:
        try:
            broadcast = self._handle.broadcast("stats")
            results = await broadcast.results_async(timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
        except DeploymentUnavailableError:
            return []  # no replica running (all dead or being replaced): nothing to sum
        return [r for r in results if isinstance(r, dict)]

    async def replica_health(self) -> list[str | None]:
        try:
            broadcast = self._handle.broadcast("check_health")
            results = await broadcast.results_async(timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            return ["a replica did not answer its health check in time"]
        except DeploymentUnavailableError as exc:
            # While Serve replaces the only replica, broadcast has nobody to ask and raises; left
            # unhandled it became Serve's plain-text 503 instead of our OpenAI-shaped one.
            return [f"no model server is available: {exc}"]
        return [None if not isinstance(r, BaseException) else _reason(r) for r in results]


def _reason(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    return f"{type(cause).__name__}: {cause}".splitlines()[0]
