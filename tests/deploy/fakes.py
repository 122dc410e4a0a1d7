"""Fakes at the deploy tests' edge: `FakeReplica`, a scripted in-process stand-in for `LLMReplica`
(replicas/llm_replica.py), and `InProcessBackend`, the `Backend` an `OpenAIService` talks to.

The deploy tests run the real `GenerationService` on the fake replica, so the service and the replica's
HTTP app are tested with no Ray and no ranks. Tests get both through the `make_service` fixture
(tests/deploy/conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tandem.deploy.generation.job_run import JobRun
from tandem.deploy.generation.service import GenerationService
from tandem.deploy.guards.limits import RequestLimits
from tandem.deploy.observability.metrics import NullMetrics
from tandem.deploy.protocol.errors import OpenAIError
from tandem.deploy.protocol.jobs import GenerateJob, JobRejected
from tandem.deploy.serving.openai_service import OpenAIService
from tandem.engine.tiny import load_tiny_tokenizer
from tandem.replicas.request_stream import RequestStream
from tandem.scheduler.messages import TokenOutput
from tandem.scheduler.sampling_params import SamplingParams

STEP_S = 0.0005
MODEL = "fake"


class FakeText:
    """Stands in for the detokenizer: token `i` reads `t<i> `, or with a `script`, step k reads script[k]."""

    stopped = False
    text = ""

    def __init__(self, script: list[str] | None = None) -> None:
        self._script = list(script or [])

    def add(self, token_id: int) -> str:
        if self._script:
            return self._script.pop(0)
        return f"t{token_id} "

    def flush(self) -> str:
        return ""


class FakeReplica:
    """Emits one token per step: id `(sum(prompt) + step + seed) % 200 + 3`, text `t<id> `; the first
    output says half the prompt came from the prefix cache. Remembers every prompt it was sent
    (`prompts`), the requests still running (`active`) and those released unfinished (`aborted`).

    `max_model_len` bounds prompt plus `max_tokens`; with `failure`, every request fails at its second
    step with that reason; a prompt holding token 13 fails validation.

    A step is a short sleep, as an engine step is: a producer that set the job's event on every loop
    turn would keep anyio's cancellation of a disconnected response from ever finding it waiting."""

    def __init__(
        self, *, max_model_len: int = 64, failure: str | None = None, script: list[str] | None = None
    ) -> None:
        self.max_model_len = max_model_len
        self.script = script  # the text of each step, the same for every request (FakeText)
        self.samplings: list[SamplingParams] = []
        self.tokenizer = load_tiny_tokenizer()
        self.failure = failure
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.prompts: list[list[int]] = []
        self.loras: list[Any] = []  # the LoRA adapter each request ran with (None: the base model)
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def admission_error(self, prompt_len: int, max_tokens: int) -> str | None:
        total = prompt_len + max_tokens
        if total <= self.max_model_len:
            return None
        return f"{total} tokens exceed the context of {self.max_model_len}"

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        sampling.validate()
        if 13 in prompt_token_ids:
            raise ValueError("token 13 is unlucky")

    async def check_structured(self, sampling: SamplingParams) -> str | None:
        return None

    async def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        listener: Callable[[], None] | None = None,
        lora: Any = None,
    ) -> RequestStream:
        rid = len(self.prompts)
        self.prompts.append(prompt_token_ids)
        self.loras.append(lora)
        self.samplings.append(sampling)
        detok: Any = FakeText(self.script)  # not an IncrementalDetokenizer: only what RequestStream calls
        stream = RequestStream(request_id or "r", rid, len(prompt_token_ids), sampling, detok, listener)
        self.active.add(stream.request_id)
        self._tasks[rid] = asyncio.create_task(self._produce(stream, prompt_token_ids, sampling))
        return stream

    async def _produce(self, stream: RequestStream, prompt: list[int], sampling: SamplingParams) -> None:
        for step in range(sampling.max_tokens):
            await asyncio.sleep(STEP_S)
            if self.failure is not None and step == 1:
                stream.fail(self.failure)
                return
            token = (sum(prompt) + step + (sampling.seed or 0)) % 200 + 3
            last = step == sampling.max_tokens - 1
            top = [(token, -0.5), (token + 1, -1.5), (token + 2, -2.5)][: sampling.logprobs or 0]
            scored = step == 0 and sampling.prompt_logprobs is not None
            stream.merge(
                TokenOutput(
                    stream.rid,
                    token,
                    "length" if last else None,
                    -0.5 if sampling.logprobs is not None else None,
                    top if sampling.logprobs is not None else None,
                    cached_tokens=len(prompt) // 2 if step == 0 else None,
                    # Prompt token k scores -k/10, its alternatives t<k+100> at -0.01 and after.
                    prompt_logprobs=[-k / 10 for k in range(1, len(prompt))] if scored else None,
                    prompt_top_logprobs=[
                        [(k + 100 + j, -0.01 * (j + 1)) for j in range(sampling.prompt_logprobs or 0)]
                        for k in range(1, len(prompt))
                    ]
                    if scored and sampling.prompt_logprobs
                    else None,
                )
            )

    async def release(self, stream: RequestStream) -> None:
        task = self._tasks.pop(stream.rid, None)
        if task is None:
            return
        task.cancel()
        self.active.discard(stream.request_id)
        if not stream.finished:
            self.aborted.append(stream.request_id)


class InProcessBackend:
    """One healthy replica's `Backend`, running jobs on a `GenerationService` in this process.

    `fail_with` makes every start raise it (an overloaded or failed replica); `stats` and `health` are
    what the replicas report, one entry each."""

    def __init__(
        self,
        replica: FakeReplica,
        *,
        chat_template: str | None = None,
        fail_with: OpenAIError | None = None,
        stats: list[dict[str, Any]] | None = None,
        health: list[str | None] | None = None,
    ) -> None:
        self.generation = GenerationService(replica, NullMetrics(), chat_template=chat_template)
        self.fail_with = fail_with
        self.stats = stats if stats is not None else [{"kv_pages_used": 0, "num_running": 0}]
        self.health = health if health is not None else [None]

    async def start(self, job: GenerateJob) -> JobRun | JobRejected:
        if self.fail_with is not None:
            raise self.fail_with
        return await self.generation.start(job)

    async def replica_stats(self) -> list[dict[str, Any]]:
        return self.stats

    async def replica_health(self) -> list[str | None]:
        return self.health


MakeService = Callable[..., tuple[OpenAIService, FakeReplica]]


def make_service(
    replica: FakeReplica | None = None,
    *,
    limits: RequestLimits | None = None,
    outcomes: Any = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = True,
    **backend: Any,
) -> tuple[OpenAIService, FakeReplica]:
    """A service for model `fake` over one fake replica; `backend` goes to `InProcessBackend`."""
    replica = replica or FakeReplica()
    service = OpenAIService(
        InProcessBackend(replica, **backend),
        MODEL,
        outcomes=outcomes,
        limits=limits,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
    )
    return service, replica
