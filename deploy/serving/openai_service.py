"""The OpenAI protocol logic of the LLMServer, shared by the HTTP routes and the Python handle API.

It checks the model name and the body, hands a `GenerateJob` to a `Backend` (the LLMServer replica's
own request path, or an in-process fake in unit tests) and turns the job's deltas into an OpenAI response
or stream chunks. A stream yields lists of chunks: each list is what the job produced since the consumer
last read, and goes out as one write. Every failure is an `OpenAIError`; a failure after a stream has
started becomes a last chunk holding the error body, since the HTTP status line is already sent by then.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from pydantic import ValidationError

from tandem.deploy.adapters.registry import AdapterRegistry
from tandem.deploy.generation.job_run import JobRun
from tandem.deploy.generation.service import GenerationService
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
    from_validation_errors,
    internal_error,
    invalid_request,
    model_not_found,
    unavailable,
)
from tandem.deploy.protocol.harmony.chat import HarmonyChat
from tandem.deploy.protocol.job_builder import chat_job, completion_job
from tandem.deploy.protocol.jobs import ChoiceDelta, GenerateJob, JobRejected
from tandem.deploy.protocol.lora_requests import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from tandem.deploy.protocol.reasoning import reasoning_format
from tandem.deploy.protocol.requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.deploy.protocol.responses import (
    CachedTokens,
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    usage_dict,
)
from tandem.scheduler.messages import LoRARequest

logger = logging.getLogger(__name__)
# Tells the other replicas what an adapter call changed: (method, args), broadcast through Serve.
Announce = Callable[[str, tuple[Any, ...]], Awaitable[None]]

ChunkBatches = AsyncGenerator[list[dict[str, Any]], None]
Response = dict[str, Any] | ChunkBatches
_Format = CompletionFormat | ChatFormat


class Backend(Protocol):
    """Where jobs run: the replica's own request path (`ReplicaBackend`), or a fake in unit tests.

    Raises `OpenAIError` for overload/unavailable.
    """

    generation: GenerationService  # its tokenization answers /tokenize, /detokenize, /tokenizer_info

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
        adapters: AdapterRegistry | None = None,
        announce: Announce | None = None,
        reasoning_parser: str | None = None,
        harmony: HarmonyChat | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = True,
    ) -> None:
        self._backend = backend
        self._adapters = adapters
        self._announce = announce
        # A harmony model's reasoning is its analysis channel (`openai_gptoss` is that parser's name).
        self._reasoning = None if harmony is not None else reasoning_format(reasoning_parser)
        self._harmony = harmony  # a gpt-oss model: chats are rendered and read as harmony
        self._tool_call_parser = tool_call_parser
        self._auto_tool_choice = enable_auto_tool_choice
        self._limits = limits or RequestLimits()
        self.served_model_name = served_model_name
        self._model_root = model_root or served_model_name
        self._created = int(time.time())
        self._outcomes = outcomes or NullOutcomes()

    async def completions(self, request: CompletionRequest) -> Response:
        try:
            lora = await self._adapter(request)
            job = completion_job(request, f"cmpl-{uuid.uuid4().hex}", time.time())
            job = dataclasses.replace(job, lora=lora) if lora is not None else job
            fmt = CompletionFormat(job.request_id, self._model_named(request), int(time.time()))
            return await self._tracked(await self._run(request, job, fmt))
        except BaseException as exc:
            self.record_outcome(outcome_of_exception(exc))
            raise

    async def chat_completions(self, request: ChatCompletionRequest) -> Response:
        try:
            lora = await self._adapter(request)
            job = chat_job(request, f"chatcmpl-{uuid.uuid4().hex}", time.time())
            job = dataclasses.replace(job, lora=lora) if lora is not None else job
            job, fmt = self._chat_format(request, job)
            return await self._tracked(await self._run(request, job, fmt))
        except BaseException as exc:
            self.record_outcome(outcome_of_exception(exc))
            raise

    def _chat_format(
        self, request: ChatCompletionRequest, job: GenerateJob
    ) -> tuple[GenerateJob, ChatFormat]:
        """The job as the model's chat format runs it, and the format that reads its replies."""
        model, created = self._model_named(request), int(time.time())
        if self._harmony is not None:
            job = self._harmony.prepare(job)
            return job, self._harmony.chat_format(job, model, created)
        if self._reasoning is not None:  # constraints apply after the reasoning (service.py)
            job = dataclasses.replace(job, reasoning_end=self._reasoning.end)
        job = self._with_tool_parser(job)
        fmt = ChatFormat(job.request_id, model, created, tools=job.tool_mode, reasoning=self._reasoning)
        return job, fmt

    async def answer(self, path: str, body: Any, *, allow_stream: bool = True) -> Response:
        """A JSON body for a route (`/v1/completions`, `/v1/chat/completions`), parsed and answered as the
        HTTP route answers it, for callers without FastAPI in front (the handle API, batch files). Every
        failure, an invalid body included, is an `OpenAIError`."""
        routes: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
        }
        request_cls = routes.get(path)
        if request_cls is None:
            raise invalid_request(f"no route {path}; use one of {', '.join(routes)}", param="url")
        try:
            # As FastAPI validates a route's body, so that the messages match the HTTP route's too.
            request = request_cls.model_validate(body, from_attributes=True)
        except ValidationError as exc:
            self.record_outcome("4xx")
            raise from_validation_errors(exc.errors()) from None
        if request.stream and not allow_stream:
            self.record_outcome("4xx")
            raise invalid_request("stream=true is not supported here", param="stream")
        if isinstance(request, ChatCompletionRequest):
            return await self.chat_completions(request)
        return await self.completions(request)

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
        adapters = self._adapters.cards() if self._adapters is not None else []
        # vLLM's cards carry the context length, which clients read to size their prompts.
        max_model_len = self._backend.generation.max_model_len
        return {"object": "list", "data": [{**c, "max_model_len": max_model_len} for c in [card, *adapters]]}

    @property
    def generation(self) -> GenerationService:
        """The replica's request path, whose tokenization the tokenizer routes answer from."""
        return self._backend.generation

    def model(self, model_id: str) -> dict[str, Any]:
        """`GET /v1/models/{id}`: the card of the base model or of an adapter served by name; 404 else."""
        for card in self.models()["data"]:
            if card["id"] == model_id:
                return dict(card)
        raise self.unknown_model(model_id)

    def check_model(self, model: str | None) -> None:
        """A 404 unless `model` is unset, the served model or an adapter it serves by name (the routes
        that only tokenize: every adapter shares the base model's tokenizer)."""
        if model is None or model == self.served_model_name:
            return
        known = self._adapters.known() if self._adapters is not None else {}
        if model not in known and model.removeprefix(f"{self.served_model_name}:") not in known:
            raise self.unknown_model(model)

    def unknown_model(self, model: str) -> OpenAIError:
        if self._adapters is None:
            return model_not_found(model, self.served_model_name)
        return self._adapters.not_found(model)

    async def load_lora_adapter(self, request: LoadLoraAdapterRequest) -> str:
        """vLLM's run-time load: the adapter is checked (a 400 naming what is wrong), served by name
        from now on on every replica, and held by this one."""
        if self._adapters is None:
            raise invalid_request("LoRA is not enabled on this server (--enable-lora)", param="lora_name")
        await self._adapters.load(request.lora_name, request.lora_path)
        if self._announce is not None:
            await self._announce("learn_lora_adapter", (request.lora_name, request.lora_path))
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoraAdapterRequest) -> str:
        """vLLM's run-time unload (a 404 for a name not served); requests running with it finish."""
        if self._adapters is None:
            raise invalid_request("LoRA is not enabled on this server (--enable-lora)", param="lora_name")
        await self._adapters.unload(request.lora_name)
        if self._announce is not None:
            await self._announce("forget_lora_adapter", (request.lora_name,))
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

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

    async def _adapter(self, request: SamplingFields) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names (None: the base model); unknown is a 404."""
        if self._adapters is None:
            if request.model is not None and request.model != self.served_model_name:
                raise model_not_found(request.model, self.served_model_name)
            return None
        return await self._adapters.resolve(request.model)

    def _with_tool_parser(self, job: GenerateJob) -> GenerateJob:
        """The server's tool-call settings on a chat job whose tools are read under tool_choice "auto"."""
        mode = job.tool_mode
        if mode is None or mode.choice != "auto":
            return job
        if not self._auto_tool_choice:
            raise invalid_request(
                'tool_choice "auto" is not enabled on this server (--enable-auto-tool-choice); use '
                '"none", "required" or a named function',
                param="tool_choice",
            )
        return dataclasses.replace(job, tool_mode=dataclasses.replace(mode, parser=self._tool_call_parser))

    def _model_named(self, request: SamplingFields) -> str:
        """The `model` a response reports: the name the request used (an adapter's), else the base's."""
        return request.model if request.model is not None else self.served_model_name

    async def _run(self, request: SamplingFields, job: GenerateJob, fmt: _Format) -> Response:
        check_job(job, self._limits)  # before admission: an oversized job must not wait for slots
        run = await self._backend.start(job)
        if isinstance(run, JobRejected):
            raise invalid_request(run.message, param=run.param, code=run.code)
        prompt_tokens = sum(run.accepted.prompt_tokens)
        if request.stream:
            usage = _UsageMode(request.include_usage, request.continuous_usage)
            stream = self._stream(run, fmt, job.num_choices, prompt_tokens, usage, CachedTokens(job.n))
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
        usage: _UsageMode,
        cached: CachedTokens,
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The job's chunks, a list per wake-up, after one empty list that `_run` takes to start it."""
        completion_tokens = 0

        def with_usage(chunk: dict[str, Any]) -> dict[str, Any]:
            # With include_usage, OpenAI sends `"usage": null` on every chunk but the last; vLLM's
            # continuous_usage_stats sends the usage so far instead.
            if usage.include:
                so_far = usage_dict(prompt_tokens, completion_tokens, cached.total)
                chunk["usage"] = so_far if usage.continuous else None
            return chunk

        try:
            yield []
            try:
                opening = [with_usage(c) for c in fmt.start_chunks(num_choices)]
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
                            batch.append(with_usage(chunk))
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
            if usage.include:
                yield [fmt.usage_chunk(usage_dict(prompt_tokens, completion_tokens, cached.total))]
        finally:
            await run.close()


def _raise_if_failed(delta: ChoiceDelta) -> None:
    if delta.finish_reason == "error":
        raise unavailable(f"the request failed on the model server: {delta.error or 'unknown error'}")
    if delta.finish_reason == "abort":
        raise unavailable("the model server aborted the request (it may be shutting down)")


@dataclasses.dataclass(frozen=True)
class _UsageMode:
    include: bool  # stream_options.include_usage: a last chunk with the usage
    continuous: bool  # vLLM's continuous_usage_stats: the usage so far on every chunk too
