"""Operator metrics of an LLMServer replica beside `ServingMetrics`: request outcomes, the admission queue
and KV use per replica (docs/metrics.md). Recorded per request or sampled once a second, never per token.

`OpenAIService` reports each generate request's outcome once:

- `ok`: answered, or streamed to the end;
- `4xx`: refused for its input (a bad body, an unknown model, a prompt over the context);
- `503`: overloaded (past `max_queued_requests`) or no replica could run it;
- `aborted`: the client went away first;
- `error`: anything else (an internal error, a failure after the stream started that is not a 503).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol, cast

OUTCOMES = ("ok", "4xx", "503", "aborted", "error")
REPLICA_METRIC_NAMES: tuple[str, ...] = (
    "tandem_requests_total",
    "tandem_admission_queue_depth",
    "tandem_admission_running",
    "tandem_replica_kv_cache_usage_ratio",
)
# A stream's error chunk has lost its HTTP status; its code tells the kind.
_SERVER_BUSY_CODES = frozenset({"overloaded", "service_unavailable", "unhealthy"})


class OutcomeSink(Protocol):
    def request_outcome(self, outcome: str) -> None: ...


class NullOutcomes:
    def request_outcome(self, outcome: str) -> None:
        pass


def outcome_of_status(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 503:
        return "503"
    return "4xx" if status < 500 else "error"


def outcome_of_error_body(body: dict[str, Any]) -> str:
    error = body.get("error") or {}
    if error.get("code") in _SERVER_BUSY_CODES:
        return "503"
    return "error" if error.get("type") == "server_error" else "4xx"


async def tracked_stream(
    chunks: AsyncGenerator[list[dict[str, Any]], None], record: Callable[[str], None]
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """`chunks`, recording the stream's outcome once it ends: `ok` at its end, the error chunk's kind,
    or `aborted` when it is closed (or cancelled) before the end. Started already, so that closing it
    unread still closes `chunks` (which aborts the request on the ranks)."""
    stream = _tracked(chunks, record)
    await anext(stream)
    return cast(AsyncGenerator[list[dict[str, Any]], None], stream)


async def _tracked(
    chunks: AsyncGenerator[list[dict[str, Any]], None], record: Callable[[str], None]
) -> AsyncGenerator[list[dict[str, Any]] | None, None]:
    outcome = "aborted"
    try:
        yield None  # taken by `tracked_stream`: the generator is now inside the `try`
        async for batch in chunks:
            for chunk in batch:
                if "error" in chunk:
                    outcome = outcome_of_error_body(chunk)
            yield batch
        if outcome == "aborted":
            outcome = "ok"
    finally:
        await chunks.aclose()
        record(outcome)


def outcome_of_exception(exc: BaseException) -> str:
    """The outcome of a request whose handling raised `exc` before any response."""
    from tandem.deploy.protocol.errors import OpenAIError

    if isinstance(exc, OpenAIError):
        return outcome_of_status(exc.status)
    if isinstance(exc, asyncio.CancelledError):
        return "aborted"
    return "error"


class ReplicaMetrics:
    """The outcome counter and the per-replica gauges, tagged with the model and the replica."""

    def __init__(self, model_name: str, replica: str) -> None:
        from ray.util import metrics

        self._model = {"model_name": model_name}
        self._replica = {"model_name": model_name, "replica": replica}
        per_replica = ("model_name", "replica")
        self._requests = metrics.Counter(
            REPLICA_METRIC_NAMES[0],
            description="Generate requests by outcome: ok, 4xx, 503, aborted, error.",
            tag_keys=("model_name", "outcome"),
        )
        self._queue_depth = metrics.Gauge(
            REPLICA_METRIC_NAMES[1],
            description="Requests waiting in the replica's admission queue for a running slot.",
            tag_keys=per_replica,
        )
        self._running = metrics.Gauge(
            REPLICA_METRIC_NAMES[2],
            description="Requests holding one of the replica's running slots (max_ongoing_requests).",
            tag_keys=per_replica,
        )
        self._kv_usage = metrics.Gauge(
            REPLICA_METRIC_NAMES[3],
            description="Fraction of the replica's KV pages held by live requests.",
            tag_keys=per_replica,
        )

    def request_outcome(self, outcome: str) -> None:
        self._requests.inc(1, tags={**self._model, "outcome": outcome})

    def sample(self, running: int, waiting: int, stats: dict[str, Any]) -> None:
        """Once a second: the admission counts and the KV use from an `LLMReplica.stats()` snapshot."""
        self._queue_depth.set(float(waiting), tags=self._replica)
        self._running.set(float(running), tags=self._replica)
        total = float(stats.get("kv_pages_total", 0) or 0)
        used = float(stats.get("kv_pages_used", 0) or 0)
        self._kv_usage.set(used / total if total > 0 else 0.0, tags=self._replica)
