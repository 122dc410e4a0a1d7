"""Per-request state in the replica: token outputs in, `GenerationChunk`s out."""

from __future__ import annotations

import asyncio

from tandem.replicas.chunks import GenerationChunk
from tandem.replicas.detokenizer import IncrementalDetokenizer
from tandem.scheduler.messages import TokenOutput
from tandem.scheduler.sampling_params import SamplingParams


class RequestStream:
    """Buffers one request's outputs until its consumer asks; never delays a chunk to batch it."""

    def __init__(
        self,
        request_id: str,
        rid: int,
        prompt_tokens: int,
        sampling: SamplingParams,
        detok: IncrementalDetokenizer,
    ) -> None:
        self.request_id = request_id
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.want_logprobs = sampling.logprobs is not None
        self.detok = detok
        self.completion_tokens = 0
        self.scheduler_done = False
        self.finished = False
        self._queue: asyncio.Queue[TokenOutput | str] = asyncio.Queue()

    def push(self, out: TokenOutput) -> None:
        self._queue.put_nowait(out)

    def fail(self, reason: str) -> None:
        self._queue.put_nowait(reason)

    async def next_chunk(self) -> GenerationChunk:
        """Wait for the next output, then fold in everything else already queued."""
        chunk = GenerationChunk(self.request_id, prompt_tokens=self.prompt_tokens)
        if self.want_logprobs:
            chunk.logprobs, chunk.top_logprobs = [], []
        self._fold(chunk, await self._queue.get())
        while not self._queue.empty() and chunk.finish_reason is None:
            self._fold(chunk, self._queue.get_nowait())
        chunk.completion_tokens = self.completion_tokens
        return chunk

    def _fold(self, chunk: GenerationChunk, item: TokenOutput | str) -> None:
        if self.finished:
            return
        if isinstance(item, str):
            chunk.finish_reason, chunk.error = "error", item
            self.finished = True
            return
        if item.cached_tokens is not None:
            chunk.cached_tokens = item.cached_tokens
        if item.token_id is not None:
            self.completion_tokens += 1
            chunk.token_ids.append(item.token_id)
            chunk.text += self.detok.add(item.token_id)
            if chunk.logprobs is not None and item.logprob is not None:
                chunk.logprobs.append(item.logprob)
            if chunk.top_logprobs is not None:
                chunk.top_logprobs.append(list(item.top_logprobs or []))
        if item.finish_reason is not None:
            self.scheduler_done = True
        if self.detok.stopped:
            chunk.finish_reason = "stop"
        elif item.finish_reason is not None:
            chunk.finish_reason = item.finish_reason
            chunk.text += self.detok.flush()
        self.finished = chunk.finish_reason is not None
