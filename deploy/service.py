"""The OpenAI protocol logic of the LLMServer, shared by the HTTP routes and the Python handle API.

It checks the model name and the body, hands a `GenerateJob` to a `Backend` (the LLMServer deployment,
or an in-process fake in unit tests) and turns the events into OpenAI responses or stream chunks.
Every failure is an `OpenAIError`; a failure after a stream has started becomes a last chunk holding the
error body, since the HTTP status line is already sent by then.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, Protocol, cast

from tandem.deploy.errors import OpenAIError, internal_error, invalid_request, model_not_found, unavailable
from tandem.deploy.job_builder import chat_job, completion_job
from tandem.deploy.jobs import ChoiceDelta, GenerateJob, JobAccepted, JobEvent, JobRejected
from tandem.deploy.limits import RequestLimits, check_job
from tandem.deploy.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.deploy.responses import ChatFormat, ChoiceResult, CompletionFormat, usage_dict
from tandem.deploy.stats import aggregate_stats

logger = logging.getLogger(__name__)

Response = dict[str, Any] | AsyncGenerator[dict[str, Any], None]
_Format = CompletionFormat | ChatFormat


class Backend(Protocol):
    """Where jobs run: the replica's own request path (`ReplicaBackend`), or a fake in unit tests.

    Raises `OpenAIError` for overload/unavailable.
    """

    def generate(self, job: GenerateJob) -> AsyncGenerator[JobEvent, None]: ...

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
        limits: RequestLimits | None = None,
    ) -> None:
        self._backend = backend
        self._limits = limits or RequestLimits()
        self.served_model_name = served_model_name
        self._model_root = model_root or served_model_name
        self._created = int(time.time())

    async def completions(self, request: CompletionRequest) -> Response:
        self._check_model(request)
        job = completion_job(request, f"cmpl-{uuid.uuid4().hex}", time.time())
        fmt = CompletionFormat(job.request_id, self.served_model_name, int(time.time()))
        return await self._run(request, job, fmt)

    async def chat_completions(self, request: ChatCompletionRequest) -> Response:
        self._check_model(request)
        job = chat_job(request, f"chatcmpl-{uuid.uuid4().hex}", time.time())
        fmt = ChatFormat(job.request_id, self.served_model_name, int(time.time()))
        return await self._run(request, job, fmt)

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
        events = self._backend.generate(job)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            raise internal_error("the model server ended the request without an answer") from None
        except BaseException:
            await events.aclose()
            raise
        if isinstance(first, JobRejected):
            await events.aclose()
            raise invalid_request(first.message, param=first.param, code=first.code)
        if not isinstance(first, JobAccepted):
            await events.aclose()
            raise internal_error(f"unexpected first event {type(first).__name__}")
        prompt_tokens = sum(first.prompt_tokens)
        if request.stream:
            stream = self._stream(events, fmt, job.num_choices, prompt_tokens, request.include_usage)
            # The job's choices are already on the ranks. Started, the stream holds the job open, so
            # closing it aborts them even if nothing was read (a client gone before the headers).
            await anext(stream)
            return cast(AsyncGenerator[dict[str, Any], None], stream)
        return await self._collect(events, fmt, job.num_choices, prompt_tokens)

    async def _collect(
        self, events: AsyncGenerator[JobEvent, None], fmt: _Format, num_choices: int, prompt_tokens: int
    ) -> dict[str, Any]:
        choices = [ChoiceResult(index=i) for i in range(num_choices)]
        async with aclosing(events):
            async for event in events:
                if isinstance(event, ChoiceDelta):
                    _raise_if_failed(event)
                    choices[event.index].add(event)
        if any(c.finish_reason is None for c in choices):
            raise unavailable("the model server stopped before every choice finished")
        completion_tokens = sum(c.num_tokens for c in choices)
        return fmt.response(choices, usage_dict(prompt_tokens, completion_tokens))

    async def _stream(
        self,
        events: AsyncGenerator[JobEvent, None],
        fmt: _Format,
        num_choices: int,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncGenerator[dict[str, Any] | None, None]:
        """The job's chunks, after one None that `_run` takes to start the generator."""
        completion_tokens = 0
        unfinished = num_choices
        async with aclosing(events):
            yield None
            try:
                for chunk in fmt.start_chunks(num_choices):
                    yield _with_usage_slot(chunk, include_usage)
                async for event in events:
                    if not isinstance(event, ChoiceDelta):
                        continue
                    _raise_if_failed(event)
                    completion_tokens += len(event.token_ids)
                    unfinished -= event.finish_reason is not None
                    delta_chunk = fmt.chunk(event)
                    if delta_chunk is not None:  # every delta goes out at once: no batching delay
                        yield _with_usage_slot(delta_chunk, include_usage)
                if unfinished:
                    raise unavailable("the model server stopped before every choice finished")
            except OpenAIError as error:
                yield error.body()
                return
            except Exception:
                logger.exception("stream %s failed", fmt.response_id)
                yield internal_error().body()
                return
        if include_usage:
            yield fmt.usage_chunk(usage_dict(prompt_tokens, completion_tokens))


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
