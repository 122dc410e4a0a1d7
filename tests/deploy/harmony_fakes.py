"""A replica at the test's edge for gpt-oss (harmony) models: it writes a scripted harmony reply, since a
tiny random model writes no harmony; its stream's detokenizer is the replica's own."""

from __future__ import annotations

import asyncio
from typing import Any

from transformers import PreTrainedTokenizerFast

from tandem.replicas.detokenizer import IncrementalDetokenizer, TokenDecoder
from tandem.replicas.request_stream import RequestStream
from tandem.scheduler.messages import TokenOutput
from tandem.scheduler.sampling_params import SamplingParams

from .fakes import STEP_S, FakeReplica
from .harmony_tokenizer import encode, harmony_tokenizer


class HarmonyReplica(FakeReplica):
    """Writes `reply` one token per step, whatever the prompt, ending at a stop token of the request's
    (as the scheduler does) or at max_tokens."""

    def __init__(self, reply: str, tokenizer: PreTrainedTokenizerFast | None = None) -> None:
        super().__init__(max_model_len=4096)
        self.tokenizer = tokenizer if tokenizer is not None else harmony_tokenizer()
        self.reply = encode(self.tokenizer, reply)
        self.generated: list[list[int]] = []  # each request's tokens, as far as it ran

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        sampling.validate()  # any prompt: the fake's unlucky token 13 is common in a harmony prompt

    async def submit(
        self, prompt_token_ids: list[int], sampling: SamplingParams, *args: Any, **kw: Any
    ) -> Any:
        stream = await super().submit(prompt_token_ids, sampling, *args, **kw)
        # The replica's own detokenizer, so that stop strings end the reply where the replica ends it.
        stream.detok = IncrementalDetokenizer(
            TokenDecoder(self.tokenizer), prompt_token_ids, sampling.stop_strings
        )
        return stream

    async def _produce(self, stream: RequestStream, prompt: list[int], sampling: SamplingParams) -> None:
        generated: list[int] = []
        self.generated.append(generated)
        for step, token in enumerate(self.reply[: sampling.max_tokens]):
            await asyncio.sleep(STEP_S)
            if stream.finished:  # a stop string ended it
                return
            generated.append(token)
            stop = token in (sampling.stop_token_ids or [])
            last = stop or step == sampling.max_tokens - 1
            finish = ("stop" if stop else "length") if last else None
            stream.merge(TokenOutput(stream.rid, token, finish, cached_tokens=0 if step == 0 else None))
            if last:
                return
