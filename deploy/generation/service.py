"""The LLMServer's request path: tokenize, check limits, run a job's choices, report metrics.

Everything here happens before a request reaches a rank, so a bad input is a `JobRejected` (a 400)
and never an engine failure. An accepted job's choices are submitted to the replica together and drained
together through a `JobRun`; closing the run aborts on the ranks whatever is still running and frees
its KV pages.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from tandem.deploy.generation.job_run import JobRun, Submitter
from tandem.deploy.generation.tokenization import Rejected, Tokenization
from tandem.deploy.observability.metrics import MetricsSink
from tandem.deploy.protocol.errors import unavailable
from tandem.deploy.protocol.job_builder import choice_sampling
from tandem.deploy.protocol.jobs import GenerateJob, JobAccepted, JobRejected
from tandem.deploy.protocol.logprobs import TokenStrings
from tandem.scheduler.sampling_params import SamplingParams

# Inputs up to this many characters are tokenized (and chat templates rendered) on the event loop: that
# takes microseconds, less than a hop to a thread and back. Longer ones go to the tokenizer thread, so a
# large prompt never stalls the other requests' streams.
INLINE_TOKENIZE_CHARS = 4096
T = TypeVar("T")


class ReplicaLike(Submitter, Protocol):
    """The part of `LLMReplica` this path uses (a fake in unit tests)."""

    tokenizer: Any

    @property
    def max_model_len(self) -> int: ...

    def admission_error(self, prompt_len: int, max_tokens: int) -> str | None: ...

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError for anything a rank must never see."""
        ...

    async def check_structured(self, sampling: SamplingParams) -> str | None:
        """Why the output constraint cannot be compiled (or not in time); None when it can."""
        ...


@dataclass
class _Choice:
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str


class GenerationService:
    """Runs `GenerateJob`s on one LLMReplica; owned by one LLMServer replica."""

    def __init__(
        self,
        replica: ReplicaLike,
        metrics: MetricsSink,
        vocab_size: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._replica = replica
        # One thread: requests' tokenizing runs in order off the loop, and the tokenizer, which is not
        # documented as thread-safe, is never used by two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")
        self._metrics = metrics
        self._vocab_size = vocab_size if vocab_size is not None else len(replica.tokenizer)
        self.tokenization = Tokenization(replica.tokenizer, chat_template, self._vocab_size)
        self._token_strings = TokenStrings(replica.tokenizer)
        self._single_tokens: dict[str, int | None] = {}  # tag text -> its token id, if it is one token

    async def start(
        self, job: GenerateJob, on_engine_done: Callable[[], None] | None = None
    ) -> JobRun | JobRejected:
        """Check the job and send all its choices to the ranks; `JobRejected` if it cannot run.

        Every choice reaches the ranks before the caller answers with headers, so the prefill overlaps
        the HTTP response start. `on_engine_done` is called once every choice's last token has arrived
        (or the run is closed first)."""
        self._metrics.queue_time(time.time() - job.arrival_time)
        job = self._constrain_after_reasoning(job)
        try:
            prompts = await self._tokenize(job)
            choices = self._choices(job, prompts)
            await self._check_constraints(job)
        except Rejected as rejected:
            return rejected.event
        accepted = JobAccepted(prompt_tokens=[len(p) for p in prompts])
        run = JobRun(
            job, accepted, len(choices), self._replica, self._metrics, self._token_strings, on_engine_done
        )
        try:
            for choice in choices:
                await run.submit(choice.index, choice.prompt_ids, choice.sampling)
        except (RuntimeError, ValueError) as exc:  # refused (draining, a rank down): a 503
            await run.close()
            raise unavailable(str(exc)) from None
        except BaseException:
            await run.close()
            raise
        self._metrics.prompt_tokens(sum(len(p) for p in prompts))
        return run

    # -- input -------------------------------------------------------------------------------------

    def _constrain_after_reasoning(self, job: GenerateJob) -> GenerateJob:
        """Under a reasoning parser, a chat's output constraint (a schema, a forced tool call) starts after
        the end-of-thinking token, as vLLM's reasoning-aware structured outputs do. A tokenizer without
        that tag as one token of its own constrains from the first token."""
        constraint = job.sampling.structured_outputs
        if job.reasoning_end is None or constraint is None:
            return job
        token = self._single_token(job.reasoning_end)
        if token is None:
            return job
        sampling = replace(job.sampling, structured_outputs=replace(constraint, after_token=token))
        return replace(job, sampling=sampling)

    def _single_token(self, text: str) -> int | None:
        if text not in self._single_tokens:
            ids = self.tokenization.encode(text, "messages", add_special_tokens=False)
            self._single_tokens[text] = ids[0] if len(ids) == 1 else None
        return self._single_tokens[text]

    async def _check_constraints(self, job: GenerateJob) -> None:
        bad = [t for t in job.sampling.logit_bias or {} if t >= self._vocab_size]
        if bad:
            raise Rejected(
                f"logit_bias keys must be token ids in [0, {self._vocab_size}), got {bad[:3]}", "logit_bias"
            )
        if job.sampling.structured_outputs is not None:
            problem = await self._replica.check_structured(job.sampling)
            if problem is not None:
                param = job.structured_param or "response_format"
                raise Rejected(f"{param} cannot be used: {problem}", param)

    async def _tokenize(self, job: GenerateJob) -> list[list[int]]:
        return await self.off_loop(_input_chars(job), self._prompt_ids, job)

    def _prompt_ids(self, job: GenerateJob) -> list[list[int]]:
        if job.messages is not None:
            return [self._render_chat(job)]
        prompts: list[list[int]] = []
        for i, prompt in enumerate(job.prompts or []):
            param = "prompt" if len(job.prompts or []) == 1 else f"prompt.{i}"
            ids = self.tokenization.encode(prompt, param) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise Rejected("the prompt is empty (no tokens)", param)
            self.tokenization.check_ids(ids, param)
            prompts.append(ids)
        return prompts

    def _render_chat(self, job: GenerateJob) -> list[int]:
        assert job.messages is not None
        return self.tokenization.render_chat(
            job.messages, tools=job.tools, template_kwargs=job.chat_template_kwargs
        )

    @property
    def max_model_len(self) -> int:
        return self._replica.max_model_len

    async def off_loop(self, chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread when the input is long (`chars`), else inline."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    def _choices(self, job: GenerateJob, prompts: list[list[int]]) -> list[_Choice]:
        choices: list[_Choice] = []
        for p, ids in enumerate(prompts):
            prompt_param = "messages" if job.messages is not None else "prompt"
            if len(prompts) > 1:
                prompt_param = f"prompt.{p}"
            max_tokens = job.max_tokens
            if max_tokens is None:
                max_tokens = self._replica.max_model_len - len(ids)
                if max_tokens < 1:
                    raise Rejected(
                        f"the prompt has {len(ids)} tokens, which fills the context length of "
                        f"{self._replica.max_model_len} tokens",
                        prompt_param,
                        "context_length_exceeded",
                    )
            reason = self._replica.admission_error(len(ids), max_tokens)
            if reason is not None:
                # The prompt is at fault when it leaves no room for even one token; max_tokens otherwise.
                alone = self._replica.admission_error(len(ids), 1) is not None
                raise Rejected(reason, prompt_param if alone else "max_tokens", "context_length_exceeded")
            for i in range(job.n):
                index = p * job.n + i
                sampling = choice_sampling(job, index, max_tokens)
                if i == 0:  # the replica's own checks, so it never refuses what we accepted
                    try:
                        self._replica.validate(ids, sampling)
                    except ValueError as exc:
                        raise Rejected(str(exc)) from None
                choices.append(_Choice(index, ids, sampling, f"{job.request_id}-{index}"))
        return choices


def _input_chars(job: GenerateJob) -> int:
    if job.messages is not None:
        return sum(len(m["content"]) for m in job.messages if isinstance(m.get("content"), str))
    return sum(len(p) if isinstance(p, str) else len(p) // 4 for p in job.prompts or [])
