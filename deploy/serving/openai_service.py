"""The OpenAI protocol logic of the LLMServer, shared by the HTTP routes and the Python handle API.

It checks the model name and the body, hands a `GenerateJob` to a `Backend` (the LLMServer replica's
own request path, or an in-process fake in unit tests) and turns the job's deltas into an OpenAI response
or stream chunks. A stream yields lists of chunks: each list is what the job produced since the consumer
last read, and goes out as one write. Every failure is an `OpenAIError`; a failure after a stream has
started becomes a last chunk holding the error body, since the HTTP status line is already sent by then.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any, Protocol

from tandem.deploy.generation.job_run import JobRun
from tandem.deploy.guards.limits import RequestLimits, check_job
from tandem.deploy.observability.replica_metrics import (
    NullOutcomes,
    OutcomeSink,
    outcome_of_exception,
    tracked_stream,
)
from tandem.deploy.observability.stats import aggregate_stats
from tandem.deploy.protocol.errors import (
    OpenAIError,
    internal_error,
    invalid_request,
    model_not_found,
    unavailable,
)
from tandem.deploy.protocol.job_builder import chat_job, completion_job
from tandem.deploy.protocol.jobs import ChoiceDelta, GenerateJob, JobRejected
from tandem.deploy.protocol.reasoning import reasoning_format
from tandem.deploy.protocol.requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.deploy.protocol.responses import (
    CachedTokens,
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    usage_dict,
)

logger = logging.getLogger(__name__)

ChunkBatches = AsyncGenerator[list[dict[str, Any]], None]
Response = dict[str, Any] | ChunkBatches
_Format = CompletionFormat | ChatFormat


class Backend(Protocol):
    """Where jobs run: the replica's own request path (`ReplicaBackend`), or a fake in unit tests.

    Raises `OpenAIError` for overload/unavailable.
    """

    async def start(self, job: GenerateJob) -> JobRun | JobRejected:
        """Admit the job and send its choices to the ranks, or say why it cannot run."""
        ...

    async def replica_stats(self) -> list[dict[str, Any]]: ...

    async def replica_health(self) -> list[str | None]:
        """One entry per running replica: None if healthy, else a short reason code (details logged)."""
        ...


class OpenAIService:
    def __init__(
        self,
        backend: Backend,
        served_model_name: str,
        model_root: str | None = None,
        outcomes: OutcomeSink | None = None,
        limits: RequestLimits | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self._backend = backend
        self._reasoning = reasoning_format(reasoning_parser)
        self._limits = limits or RequestLimits()
        self.served_model_name = served_model_name
        self._model_root = model_root or served_model_name
        self._created = int(time.time())
        self._outcomes = outcomes or NullOutcomes()

    async def completions(self, request: CompletionRequest) -> Response:
        try:
            self._check_model(request)
            job = completion_job(request, f"cmpl-{uuid.uuid4().hex}", time.time())
            fmt = CompletionFormat(job.request_id, self.served_model_name, int(time.time()))
            return await self._tracked(await self._run(request, job, fmt))
        except BaseException as exc:
            self.record_outcome(outcome_of_exception(exc))
            raise

    async def chat_completions(self, request: ChatCompletionRequest) -> Response:
        try:
            self._check_model(request)
            job = chat_job(request, f"chatcmpl-{uuid.uuid4().hex}", time.time())
            if self._reasoning is not None:  # constraints apply after the reasoning (service.py)
                job = replace(job, reasoning_end=self._reasoning.end)
            fmt = ChatFormat(
                job.request_id,
                self.served_model_name,
                int(time.time()),
                tools=job.tool_mode,
                reasoning=self._reasoning,
            )
            return await self._tracked(await self._run(request, job, fmt))
        except BaseException as exc:
            self.record_outcome(outcome_of_exception(exc))
            raise

    def record_outcome(self, outcome: str) -> None:
        """One generate request's outcome (observability/replica_metrics.py); also for bodies refused before
        they reach the service."""
        self._outcomes.request_outcome(outcome)

    async def _tracked(self, response: Response) -> Response:
        if isinstance(response, dict):
            self.record_outcome("ok")
            return response
        return await tracked_stream(response, self.record_outcome)

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "tandem",
            "root": self._model_root,
            "parent": None,
        }
        return {"object": "list", "data": [card]}

    async def stats(self) -> dict[str, Any]:
        return aggregate_stats(await self._backend.replica_stats())

    async def health(self) -> str | None:
        """None when every replica (and each of its ranks) is healthy; otherwise the replicas' reason
        codes (e.g. `rank_unreachable`), each once."""
        results = await self._backend.replica_health()
        if not results:
            return "no_replica"
        failures = sorted({r for r in results if r is not None})
        return ",".join(failures) if failures else None

    def _check_model(self, request: SamplingFields) -> None:
        if request.model is not None and request.model != self.served_model_name:
            raise model_not_found(request.model, self.served_model_name)

    async def _run(self, request: SamplingFields, job: GenerateJob, fmt: _Format) -> Response:
        check_job(job, self._limits)  # before admission: an oversized job must not wait for slots
        run = await self._backend.start(job)
        if isinstance(run, JobRejected):
            raise invalid_request(run.message, param=run.param, code=run.code)
        prompt_tokens = sum(run.accepted.prompt_tokens)
        if request.stream:
            stream = self._stream(
                run, fmt, job.num_choices, prompt_tokens, request.include_usage, CachedTokens(job.n)
            )
            # Started, the generator owns the run: closing it releases the choices even if nothing was
            # read (a client gone before the headers). An unstarted generator would skip its cleanup.
            await anext(stream)
            return stream
        try:
            return await self._collect(run, fmt, job.num_choices, prompt_tokens, CachedTokens(job.n))
        finally:
            await run.close()

    async def _collect(
        self, run: JobRun, fmt: _Format, num_choices: int, prompt_tokens: int, cached: CachedTokens
    ) -> dict[str, Any]:
        choices = [ChoiceResult(index=i) for i in range(num_choices)]
        while not run.done:
            for delta in await run.next():
                _raise_if_failed(delta)
                choices[delta.index].add(delta)
                cached.add(delta)
        completion_tokens = sum(c.num_tokens for c in choices)
        return fmt.response(choices, usage_dict(prompt_tokens, completion_tokens, cached.total))

    async def _stream(
        self,
        run: JobRun,
        fmt: _Format,
        num_choices: int,
        prompt_tokens: int,
        include_usage: bool,
        cached: CachedTokens,
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The job's chunks, a list per wake-up, after one empty list that `_run` takes to start it."""
        completion_tokens = 0
        try:
            yield []
            try:
                opening = [_with_usage_slot(c, include_usage) for c in fmt.start_chunks(num_choices)]
                if opening:
                    yield opening
                batch: list[dict[str, Any]] = []
                while not run.done:
                    for delta in await run.next():
                        _raise_if_failed(delta)
                        cached.add(delta)
                        completion_tokens += len(delta.token_ids)
                        chunk = fmt.chunk(delta)
                        if chunk is not None:
                            batch.append(_with_usage_slot(chunk, include_usage))
                    if batch:
                        yield batch
                        batch = []
            except OpenAIError as error:
                yield [error.body()]
                return
            except Exception:
                logger.exception("stream %s failed", fmt.response_id)
                yield [internal_error().body()]
                return
            if include_usage:
                yield [fmt.usage_chunk(usage_dict(prompt_tokens, completion_tokens, cached.total))]
        finally:
            await run.close()


def _raise_if_failed(delta: ChoiceDelta) -> None:
    if delta.finish_reason == "error":
        raise unavailable(f"the request failed on the model server: {delta.error or 'unknown error'}")
    if delta.finish_reason == "abort":
        raise unavailable("the model server aborted the request (it may be shutting down)")


def _with_usage_slot(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    # With include_usage, OpenAI sends `"usage": null` on every chunk but the last.
    if include_usage:
        chunk["usage"] = None
    return chunk
