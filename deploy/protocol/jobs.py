"""What the OpenAI layer hands the request path: one `GenerateJob` in, a stream of `JobEvent`s out.

`OpenAIService` turns an OpenAI body into a job (protocol checks done); `GenerationService`, which owns the
tokenizer, tokenizes, checks the context length and runs the job's choices. Its first event is always
`JobAccepted` or `JobRejected`, so the service can answer 400 before it commits to a 200 stream.
Plain dataclasses that carry no OpenAI formatting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.deploy.protocol.tool_calls import ToolMode
from tandem.scheduler.messages import LoRARequest
from tandem.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateJob:
    """One API request: `len(prompts) * n` choices (completions) or `n` choices of one chat."""

    request_id: str
    sampling: SamplingParams  # max_tokens is replaced by the resolved value on the server
    n: int = 1
    prompts: list[str | list[int]] | None = None  # completions
    messages: list[dict[str, Any]] | None = None  # chat, rendered by the tokenizer's chat template
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None  # None: the rest of the context window
    token_strings: bool = False  # resolve logprob token ids to strings
    arrival_time: float = 0.0  # wall clock at the replica, for the queue-time metric
    structured_param: str | None = None  # the field that set sampling.structured_outputs, for a 400
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool dicts, handed to the chat template
    tool_mode: ToolMode | None = None  # chat: how replies are read for tool calls
    lora: LoRARequest | None = None  # the LoRA adapter the request's `model` names; None: the base model
    echo: bool = False  # completions: each choice starts with its prompt (and its logprobs, if asked)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, its one sampled token dropped
    reasoning_end: str | None = None  # chat under a reasoning parser: output constraints start after it

    @property
    def num_choices(self) -> int:
        return self.n * (len(self.prompts) if self.prompts is not None else 1)


@dataclass(frozen=True)
class JobAccepted:
    prompt_tokens: list[int]  # per prompt


@dataclass(frozen=True)
class JobRejected:
    """An input the model cannot take (too long, bad token ids, template failure): a 400."""

    message: str
    param: str | None = None
    code: str = "invalid_value"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None for a prompt's first token, which nothing precedes
    top: list[tuple[str, float]] = field(default_factory=list)  # best first


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice. The last delta of a choice has `finish_reason` set."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    cached_tokens: int | None = None  # on a choice's first delta: prompt tokens from the prefix cache


JobEvent = JobAccepted | JobRejected | ChoiceDelta
