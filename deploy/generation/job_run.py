"""One accepted job's choices on the replica, drained together: `next()` returns every choice's new output.

The replica's receive loop merges each engine step into the choices' `RequestStream` slots and wakes
the job through one listener. The job's consumer (an SSE response, a non-streaming collector or a handle
stream) then takes all the slots in one pass, so a delta carries everything produced since that
consumer last read: one step while it keeps up, several when it lags. No generator sits between the
slot and the response.

Metrics are recorded per delta and per job, never per token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from tandem.deploy.observability.metrics import MetricsSink
from tandem.deploy.protocol.jobs import ChoiceDelta, GenerateJob, JobAccepted
from tandem.deploy.protocol.logprobs import TokenStrings
from tandem.replicas.chunks import GenerationChunk
from tandem.replicas.request_stream import RequestStream
from tandem.scheduler.messages import LoRARequest
from tandem.scheduler.sampling_params import SamplingParams


class Submitter(Protocol):
    """The part of `LLMReplica` a job run uses."""

    async def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        listener: Callable[[], None] | None = None,
        lora: LoRARequest | None = None,
    ) -> RequestStream: ...

    async def release(self, stream: RequestStream) -> None: ...


class JobRun:
    """The streams of one job's choices. `close()` must be called once the caller is done with it."""

    def __init__(
        self,
        job: GenerateJob,
        accepted: JobAccepted,
        num_choices: int,
        replica: Submitter,
        metrics: MetricsSink,
        token_strings: TokenStrings,
        on_engine_done: Callable[[], None] | None = None,
    ) -> None:
        self.job = job
        self.accepted = accepted
        self._replica = replica
        self._metrics = metrics
        self._token_strings = token_strings
        self._on_engine_done = on_engine_done
        self._num_choices = num_choices
        self._streams: list[tuple[int, RequestStream]] = []
        self._by_index: dict[int, RequestStream] = {}
        self._finished: set[int] = set()  # choices whose last output has reached the replica
        self._untaken = 0  # submitted choices whose last delta has not been returned by next()
        self._ready = asyncio.Event()
        self._last_time: dict[int, float] = {}
        self._tokens = 0
        self._first_token_seen = False
        self._closed = False
        self._prompts: dict[int, list[int]] = {}  # with echo: the choices whose prompt is still to be sent

    async def submit(self, index: int, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Send one choice to the ranks."""
        stream = await self._replica.submit(
            prompt_ids,
            sampling,
            f"{self.job.request_id}-{index}",
            lambda: self._on_output(index),
            lora=self.job.lora,
        )
        self._streams.append((index, stream))
        self._by_index[index] = stream
        if self.job.echo:
            self._prompts[index] = prompt_ids
        self._untaken += 1
        self._on_output(index)  # output may have arrived before the stream was known here

    @property
    def done(self) -> bool:
        """Every choice's last delta has been returned."""
        return self._untaken == 0

    def _on_output(self, index: int) -> None:
        self._ready.set()
        stream = self._by_index.get(index)
        if stream is not None and stream.finished and index not in self._finished:
            self._finished.add(index)
            if len(self._finished) == self._num_choices:
                self._engine_done()

    def _engine_done(self) -> None:
        if self._on_engine_done is not None:
            callback, self._on_engine_done = self._on_engine_done, None
            callback()

    async def next(self) -> list[ChoiceDelta]:
        """Wait until some choice has output, then return every choice's new output."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            deltas: list[ChoiceDelta] = []
            now = time.time()
            for index, stream in self._streams:
                chunk = stream.take()
                if chunk is not None:
                    deltas.append(self._delta(index, chunk, now))
                    if chunk.finish_reason is not None:
                        self._untaken -= 1
            if deltas:
                return deltas

    def _delta(self, index: int, chunk: GenerationChunk, now: float) -> ChoiceDelta:
        if chunk.cached_tokens is not None and index % self.job.n == 0:  # per prompt, as usage counts
            self._metrics.cached_tokens(chunk.cached_tokens)
        count = len(chunk.token_ids)
        if count:
            self._tokens += count
            if not self._first_token_seen:
                self._first_token_seen = True
                self._metrics.first_token(now - self.job.arrival_time)
            last = self._last_time.get(index)
            if last is not None:
                self._metrics.inter_token(now - last, count)
            self._last_time[index] = now
        logprobs = None
        if self.job.token_strings and chunk.logprobs is not None:
            logprobs = self._token_strings.entries(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
        text, token_ids, finish_reason = chunk.text, chunk.token_ids, chunk.finish_reason
        if self.job.echo_only:  # the one token generated along with the prompt's scores is not shown
            text, token_ids, logprobs = "", [], [] if logprobs is not None else None
            if finish_reason in ("stop", "length"):
                finish_reason = "length"
        prompt = self._prompts.get(index)
        if prompt is not None and (chunk.token_ids or chunk.finish_reason is not None):
            del self._prompts[index]
            text = self._prompt_text(index, prompt) + text
            if self.job.token_strings:
                entries = self._token_strings.prompt_entries(
                    prompt, chunk.prompt_logprobs, chunk.prompt_top_logprobs
                )
                logprobs = entries + (logprobs or [])
        return ChoiceDelta(
            index=index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            error=chunk.error,
            cached_tokens=chunk.cached_tokens,
        )

    def _prompt_text(self, index: int, prompt_ids: list[int]) -> str:
        """The prompt as the client sent it: its string, or a token-id prompt's decoded text."""
        sent = (self.job.prompts or [])[index // self.job.n]
        return sent if isinstance(sent, str) else self._token_strings.decode(prompt_ids)

    async def close(self) -> None:
        """Release every choice (aborting on the ranks those still running) and record the job."""
        if self._closed:
            return
        self._closed = True
        for _, stream in self._streams:
            await self._replica.release(stream)
        self._engine_done()
        self._metrics.generation_tokens(self._tokens)
        if self.done and self._streams:
            self._metrics.request_done(time.time() - self.job.arrival_time)
