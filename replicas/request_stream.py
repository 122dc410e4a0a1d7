"""Per-request state in the replica: a slot that the receive loop fills and the request's consumer drains.

The replica's receive loop calls `merge` once per token output of an engine step: it detokenizes, checks
stop strings and appends to the slot, with no awaiting and no queue per token. The consumer takes
everything merged since it last read (`take`), so a client that keeps up gets one step per chunk and
one that lags gets several steps in one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.replicas.chunks import GenerationChunk
from tandem.replicas.detokenizer import IncrementalDetokenizer
from tandem.scheduler.messages import TokenOutput
from tandem.scheduler.sampling_params import SamplingParams


class RequestStream:
    """One request's output slot. `listener`, if set, is called whenever the slot gains output."""

    def __init__(
        self,
        request_id: str,
        rid: int,
        prompt_tokens: int,
        sampling: SamplingParams,
        detok: IncrementalDetokenizer,
        listener: Callable[[], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.want_logprobs = sampling.logprobs is not None
        self.detok = detok
        self.listener = listener
        self.completion_tokens = 0
        # The ranks need no abort for this request: they finished it, or were already sent one.
        self.scheduler_done = False
        self.finished = False  # the last output is in the slot (or was taken): nothing more will come
        self.taken_last = False  # the consumer has taken the chunk with the finish reason
        self._slot = self._empty()
        self._ready = asyncio.Event()

    def _empty(self) -> GenerationChunk:
        chunk = GenerationChunk(self.request_id, prompt_tokens=self.prompt_tokens)
        if self.want_logprobs:
            chunk.logprobs, chunk.top_logprobs = [], []
        return chunk

    # ---- the receive loop's side -------------------------------------------------------------
    def merge(self, out: TokenOutput) -> None:
        """Fold one token output into the slot. Ends the stream on a stop string or the rank's finish."""
        if self.finished:
            return
        slot = self._slot
        if out.cached_tokens is not None:
            slot.cached_tokens = out.cached_tokens
        if out.prompt_logprobs is not None:
            slot.prompt_logprobs = out.prompt_logprobs
            slot.prompt_top_logprobs = out.prompt_top_logprobs
        if out.token_id is not None:
            self.completion_tokens += 1
            slot.token_ids.append(out.token_id)
            slot.text += self.detok.add(out.token_id)
            if slot.logprobs is not None and out.logprob is not None:
                slot.logprobs.append(out.logprob)
            if slot.top_logprobs is not None:
                slot.top_logprobs.append(list(out.top_logprobs or []))
        if out.finish_reason is not None:
            self.scheduler_done = True
        if self.detok.stopped:
            slot.finish_reason = "stop"
        elif out.finish_reason is not None:
            slot.finish_reason = out.finish_reason
            slot.text += self.detok.flush()
        self.finished = slot.finish_reason is not None
        self._notify()

    def fail(self, reason: str) -> None:
        """End the stream with an error (a rank died, the replica stops): the ranks get no abort for it,
        since they are gone or going, and a send to them could wait for a peer that never returns."""
        if self.finished:
            return
        self._slot.finish_reason, self._slot.error = "error", reason
        self.finished = True
        self.scheduler_done = True
        self._notify()

    def _notify(self) -> None:
        self._ready.set()
        if self.listener is not None:
            self.listener()

    # ---- the consumer's side -----------------------------------------------------------------
    @property
    def has_output(self) -> bool:
        return self._ready.is_set()

    def take(self) -> GenerationChunk | None:
        """Everything merged since the last take, or None if nothing was."""
        if not self._ready.is_set():
            return None
        chunk, self._slot = self._slot, self._empty()
        self._ready.clear()
        chunk.completion_tokens = self.completion_tokens
        self.taken_last = chunk.finish_reason is not None
        return chunk

    async def next_chunk(self) -> GenerationChunk:
        """Wait for output, then take all of it."""
        await self._ready.wait()
        chunk = self.take()
        assert chunk is not None
        return chunk
