"""The LLMServer's request path: tokenize, check limits, run a job's choices, report metrics.

Everything here happens before a request reaches a rank, so a bad input is a `JobRejected` (a 400)
and never an engine failure. A job's choices run as concurrent `LLMReplica.generate` streams; their
chunks are forwarded the moment they arrive (no batching delay). Closing the job's stream closes every
choice's stream, which aborts the requests on the ranks and frees their KV pages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.deploy.job_builder import choice_sampling
from tandem.deploy.jobs import ChoiceDelta, GenerateJob, JobAccepted, JobEvent, JobRejected
from tandem.deploy.logprobs import TokenStrings
from tandem.deploy.metrics import MetricsSink
from tandem.deploy.templates import forbidden_template_kwargs
from tandem.replicas.chunks import GenerationChunk
from tandem.scheduler.sampling_params import SamplingParams

# Inputs up to this many characters are tokenized (and chat templates rendered) on the event loop: that
# takes microseconds, less than a hop to a thread and back. Longer ones go to the tokenizer thread, so a
# large prompt never stalls the other requests' streams.
INLINE_TOKENIZE_CHARS = 4096


class ReplicaLike(Protocol):
    """The part of `LLMReplica` this path uses (a fake in unit tests)."""

    tokenizer: Any

    @property
    def max_model_len(self) -> int: ...

    def admission_error(self, prompt_len: int, max_tokens: int) -> str | None: ...

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError for anything a rank must never see."""
        ...

    def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[GenerationChunk, None]: ...


class Rejected(Exception):
    """A job the model cannot take; becomes a `JobRejected` event."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.event = JobRejected(message, param, code)


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
        self._chat_template = chat_template  # None: the tokenizer's own
        # One thread: requests' tokenizing runs in order off the loop, and the tokenizer, which is not
        # documented as thread-safe, is never used by two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")
        self._metrics = metrics
        self._tokenizer = replica.tokenizer
        self._vocab_size = vocab_size if vocab_size is not None else len(replica.tokenizer)
        self._token_strings = TokenStrings(replica.tokenizer)

    async def run(self, job: GenerateJob) -> AsyncGenerator[JobEvent, None]:
        """`JobAccepted` or `JobRejected` first, then every choice's deltas as they come."""
        start = time.time()
        self._metrics.queue_time(start - job.arrival_time)
        try:
            prompts = await self._tokenize(job)
            choices = self._choices(job, prompts)
        except Rejected as rejected:
            yield rejected.event
            return
        # Every choice goes to the ranks now, before the caller answers with headers: the prefill
        # overlaps the HTTP response start rather than waiting for the body to be iterated.
        started = [_Started(choice, self._replica) for choice in choices]
        try:
            await asyncio.sleep(0)  # one loop turn: the first pulls run up to their send to the ranks
            yield JobAccepted(prompt_tokens=[len(p) for p in prompts])
            self._metrics.prompt_tokens(sum(len(p) for p in prompts))
            stream = self._one(started[0], job) if len(started) == 1 else self._merged(started, job)
            first_token_seen = False
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    if delta.token_ids and not first_token_seen:
                        first_token_seen = True
                        self._metrics.first_token(time.time() - job.arrival_time)
                    yield delta
            self._metrics.request_done(time.time() - job.arrival_time)
        finally:
            for one in started:  # a job closed early (or never iterated) aborts its choices on the ranks
                await one.close()

    # -- input -------------------------------------------------------------------------------------

    async def _tokenize(self, job: GenerateJob) -> list[list[int]]:
        if _input_chars(job) <= INLINE_TOKENIZE_CHARS:
            return self._prompt_ids(job)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, self._prompt_ids, job)

    def _prompt_ids(self, job: GenerateJob) -> list[list[int]]:
        if job.messages is not None:
            return [self._render_chat(job)]
        prompts: list[list[int]] = []
        for i, prompt in enumerate(job.prompts or []):
            param = "prompt" if len(job.prompts or []) == 1 else f"prompt.{i}"
            ids = self._encode(prompt, param) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise Rejected("the prompt is empty (no tokens)", param)
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            if bad:
                raise Rejected(f"token ids must lie in [0, {self._vocab_size}), got {bad[:3]}", param)
            prompts.append(ids)
        return prompts

    def _render_chat(self, job: GenerateJob) -> list[int]:
        extra = dict(job.chat_template_kwargs or {})
        clash = forbidden_template_kwargs(extra)
        if clash:  # the protocol refuses these already; a job built elsewhere must not get through
            raise Rejected(f"chat_template_kwargs may not set {clash}", "chat_template_kwargs")
        try:
            text = self._tokenizer.apply_chat_template(
                job.messages,
                chat_template=self._chat_template,
                tokenize=False,
                add_generation_prompt=True,
                **extra,
            )
        except Exception as exc:  # a template raising on odd input is the client's 400, not our 500
            raise Rejected(f"the chat template failed on these messages: {exc}", "messages") from None
        # The template writes any BOS itself; adding special tokens again would double it.
        ids = self._encode(str(text), "messages", add_special_tokens=False)
        if not ids:
            raise Rejected("the rendered chat prompt is empty", "messages")
        return ids

    def _encode(self, text: str, param: str, **kwargs: Any) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # JSON may escape a lone surrogate ("\ud83e"): a Python str, but not Unicode text, and the
            # tokenizer raises a TypeError on it. That is the client's 400, not our 500.
            raise Rejected(
                f"the text is not valid Unicode ({exc.reason} at character {exc.start})", param
            ) from None
        return list(self._tokenizer.encode(text, **kwargs))

    def _choices(self, job: GenerateJob, prompts: list[list[int]]) -> list[_Choice]:
        choices: list[_Choice] = []
        for p, ids in enumerate(prompts):
            max_tokens = job.max_tokens
            if max_tokens is None:
                max_tokens = self._replica.max_model_len - len(ids)
                if max_tokens < 1:
                    raise Rejected(
                        f"the prompt has {len(ids)} tokens, which fills the context length of "
                        f"{self._replica.max_model_len} tokens",
                        "messages" if job.messages is not None else "prompt",
                        "context_length_exceeded",
                    )
            reason = self._replica.admission_error(len(ids), max_tokens)
            if reason is not None:
                raise Rejected(reason, "max_tokens", "context_length_exceeded")
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

    # -- output ------------------------------------------------------------------------------------

    async def _one(self, started: _Started, job: GenerateJob) -> AsyncGenerator[ChoiceDelta, None]:
        last = time.time()
        choice = started.choice
        try:
            first = await started.first
        except (RuntimeError, ValueError) as exc:  # refused (draining, a rank down): a 503
            yield ChoiceDelta(choice.index, finish_reason="error", error=str(exc))
            return
        if first is None:
            return
        async with aclosing(started.stream) as chunks:  # closing it aborts the request on the ranks
            async for chunk in _prepend(first, chunks):
                now = time.time()
                if chunk.token_ids:
                    self._metrics.generation_tokens(len(chunk.token_ids))
                    if chunk.completion_tokens > len(chunk.token_ids):  # not the first token
                        self._metrics.inter_token(now - last, len(chunk.token_ids))
                    last = now
                yield self._delta(choice.index, chunk, job.token_strings)

    async def _merged(self, choices: list[_Started], job: GenerateJob) -> AsyncGenerator[ChoiceDelta, None]:
        queue: asyncio.Queue[ChoiceDelta | None] = asyncio.Queue()

        async def pump(choice: _Started) -> None:
            try:
                async with aclosing(self._one(choice, job)) as deltas:
                    async for delta in deltas:
                        queue.put_nowait(delta)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                yield item
            for task in tasks:  # surface a pump's exception rather than dropping it
                task.result()
        finally:
            for task in tasks:
                task.cancel()  # cancellation reaches each LLMReplica.generate, which aborts it
            await asyncio.gather(*tasks, return_exceptions=True)

    def _delta(self, index: int, chunk: GenerationChunk, token_strings: bool) -> ChoiceDelta:
        logprobs = None
        if token_strings and chunk.logprobs is not None:
            logprobs = self._token_strings.entries(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
        return ChoiceDelta(
            index=index,
            text=chunk.text,
            token_ids=list(chunk.token_ids),
            logprobs=logprobs,
            finish_reason=chunk.finish_reason,
            error=chunk.error,
        )


class _Started:
    """One choice's `LLMReplica.generate` stream, started at once: a task pulls its first chunk, which
    sends the request to the ranks without waiting for a consumer."""

    def __init__(self, choice: _Choice, replica: ReplicaLike) -> None:
        self.choice = choice
        self.stream = replica.generate(choice.prompt_ids, choice.sampling, request_id=choice.request_id)
        self.first: asyncio.Task[GenerationChunk | None] = asyncio.ensure_future(self._pull_first())

    async def _pull_first(self) -> GenerationChunk | None:
        try:
            return await anext(self.stream)
        except StopAsyncIteration:  # a Task cannot carry it: None means the stream was empty
            return None

    async def close(self) -> None:
        """Stop the first pull if it still runs, then close the stream (which aborts the request on
        the ranks if it has not finished); safe to call more than once."""
        if not self.first.done():
            self.first.cancel()
            await asyncio.wait([self.first])  # a cancel of our own caller still propagates
        if not self.first.cancelled():
            self.first.exception()  # consumed by `_one` or not at all: either way, not an error here
        await self.stream.aclose()


def _input_chars(job: GenerateJob) -> int:
    if job.messages is not None:
        return sum(len(m["content"]) for m in job.messages if isinstance(m.get("content"), str))
    return sum(len(p) if isinstance(p, str) else len(p) // 4 for p in job.prompts or [])


async def _prepend(
    first: GenerationChunk, rest: AsyncGenerator[GenerationChunk, None]
) -> AsyncGenerator[GenerationChunk, None]:
    yield first
    async for chunk in rest:
        yield chunk
