"""OpenAI request bodies for `/v1/completions` and `/v1/chat/completions`, validated by pydantic.

The same models parse HTTP bodies (FastAPI) and the dicts handed to the Python handle API, so both give
the same 400s. Ranges follow OpenAI's where OpenAI states one; vLLM-style extensions (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`) use the offline `SamplingParams` ranges.

A top-level field the request models do not declare is a 400 naming every such field, as OpenAI's API
answers ("Unrecognized request argument supplied: max_token"): a misspelt `max_token` must not be dropped
in silence. The vLLM extensions tandem accepts are declared fields, listed in `VLLM_EXTENSIONS`. OpenAI
fields we know but do not implement are declared too (structured_fields.py) and refused when set to
anything but their neutral value. The nested objects a client writes (stream_options, response_format,
structured_outputs, tools, tool_choice) refuse unknown keys the same way, named by their path
(`stream_options.foo`); messages ignore them, since SDKs send back the assistant messages they received,
with keys such as `refusal` or `annotations`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tandem.deploy.protocol.structured_fields import StructuredFields, ToolFields
from tandem.deploy.protocol.templates import forbidden_template_kwargs, non_json_template_value
from tandem.scheduler.sampling_params import MAX_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Bounds that keep every integer representable on the wire (msgpack, int64 tensors) and in the engine.
_TOKEN_ID_MAX = 2**31 - 1
_TOP_K_MAX = 2**30
MAX_N = 128  # OpenAI's limit on `n`

TokenId = Annotated[int, Field(ge=0, le=_TOKEN_ID_MAX)]
StopText = Annotated[str, Field(min_length=1)]

_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)
# The bodies themselves: an undeclared top-level field is an error (errors.py names every one).
_BODY_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)

# The vLLM request extensions tandem takes, beyond OpenAI's fields (each a declared field below or in
# structured_fields.py; docs/serve-config.md lists them). Any other unknown field is a 400.
VLLM_EXTENSIONS: tuple[str, ...] = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "chat_template_kwargs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "add_generation_prompt",
    "continue_final_message",
    "prompt_logprobs",
    "use_beam_search",
)


class StreamOptions(BaseModel):
    model_config = _BODY_CONFIG

    include_usage: bool = Field(
        default=False, description="Send a last chunk with `usage` and no choices before `[DONE]`."
    )
    continuous_usage_stats: bool = Field(
        default=False,
        description="vLLM's: with include_usage, every chunk carries the usage so far (not null).",
    )


class SamplingFields(StructuredFields):
    """Fields shared by both endpoints: the model, the sampling knobs and the streaming switches."""

    model_config = _BODY_CONFIG

    model: str | None = Field(
        default=None, description="Served model name; unset addresses the one model this app serves."
    )
    n: int = Field(default=1, ge=1, le=MAX_N, description="Completions to generate for each prompt.")
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate per choice.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, le=_TOP_K_MAX, description="Keep the k likeliest; -1/0: off.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x top prob.")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI presence penalty.")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI frequency penalty.")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0, description="Multiplicative repetition penalty; 1 is off."
    )
    seed: int | None = Field(
        default=None, ge=INT64_MIN, le=INT64_MAX, description="Seed for reproducible sampling."
    )
    stop: StopText | list[StopText] | None = Field(
        default=None, description="Strings that end the text (not included), matched across tokens."
    )
    stop_token_ids: list[TokenId] | None = Field(default=None, description="Token ids that end the text.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")
    stream: bool = Field(default=False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(default=None, description="Options of a streamed response.")
    user: str | None = Field(default=None, description="End-user id; accepted and ignored.")
    prompt_cache_key: str | None = Field(default=None, description="OpenAI's cache hint; accepted, ignored.")
    safety_identifier: str | None = Field(default=None, description="End-user id; accepted and ignored.")
    # tandem's own field (neither OpenAI's nor vLLM's, which has no per-request switch): the one extra
    # body key a client sends to keep its request out of speculative decoding.
    speculative: bool = Field(
        default=True,
        description="With the server's speculative_config: false decodes this request without drafts.",
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`, which takes effect with include_usage."""
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    model_config = _BODY_CONFIG

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="A prompt, a list of prompts, token ids, or a list of token-id lists."
    )
    max_tokens: int | None = Field(
        default=None, ge=0, description="Most tokens to generate per choice; 0 only with echo (scoring)."
    )
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Return the logprobs of this many top tokens."
    )
    echo: bool = Field(
        default=False,
        description="Return the prompt before the completion; with logprobs, the prompt tokens' logprobs too "
        "(the first is null), as lm-eval's loglikelihood tasks read them.",
    )
    suffix: str | None = Field(default=None, description="Not supported: must be unset.")

    # Field validators (not a model validator) so a 400 names the offending field in `param`.
    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix is not None:
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [[int(p) for p in prompt]]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = _CONFIG

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text of this part.")


class CalledFunction(BaseModel):
    model_config = _CONFIG

    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments, as JSON text.")


class MessageToolCall(BaseModel):
    model_config = _CONFIG

    id: str = Field(description="The call's id, which a tool message answers with tool_call_id.")
    type: Literal["function"] = Field(default="function", description="Only function calls.")
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = _CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: str | list[TextPart] | None = Field(default=None, description="Text, or a list of text parts.")
    name: str | None = Field(default=None, description="Optional participant name.")
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="An assistant's calls.")
    tool_call_id: str | None = Field(default=None, description="The call a tool message answers.")
    reasoning_content: str | None = Field(
        default=None, description="An assistant's reasoning, as a reply gave it (templates that show it)."
    )

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (list content flattened to its text)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            # Templates (Qwen's, Llama's) write the arguments with `tojson`: hand them the object, as
            # vLLM does, or they would be quoted twice.
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def checked_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A client's `chat_template_kwargs`, or a ValueError: none may change the template or how it is
    applied, and each value is plain JSON."""
    if kwargs:
        forbidden = forbidden_template_kwargs(kwargs)
        if forbidden:
            raise ValueError(f"chat_template_kwargs may not set {forbidden}: the server picks the template")
        key = non_json_template_value(kwargs)
        if key is not None:
            raise ValueError(
                f"chat_template_kwargs.{key} must be plain JSON (null, bool, number, string, list or object)"
            )
    return kwargs


def _arguments(call: MessageToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class ChatCompletionRequest(SamplingFields, ToolFields):
    """`POST /v1/chat/completions`."""

    model_config = _BODY_CONFIG

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate per choice; wins over max_tokens."
    )
    logprobs: bool = Field(default=False, description="Return the logprob of each output token.")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="With logprobs: this many alternatives per token."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Extra variables for the chat template (e.g. enable_thinking). Keys that would "
        "change the template or how it is applied (chat_template, tokenize, ...) are refused.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_stays_the_servers(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return checked_template_kwargs(kwargs)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs=true")
        return top_logprobs

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
