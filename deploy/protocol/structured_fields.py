"""Request fields for structured outputs, logit_bias, min_tokens and tool calling, and the OpenAI fields
we do not implement (a 400 `unsupported_parameter` when set to anything but their neutral value).

Structured outputs come as OpenAI's `response_format`, or as vLLM's extra fields: `structured_outputs`
(a dict with one of json, regex, choice, grammar, json_object) and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)
# Objects the client writes itself (not ones an SDK sends back): an unknown key is a 400, as at the top.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(default="response", description="A name for the schema.")
    description: str | None = Field(default=None, description="What the format is for.")
    # `schema` would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema", description="The JSON schema.")
    strict: bool | None = Field(default=None, description="Outputs always follow the schema here.")


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"] = Field(description="The output's format.")
    json_schema: JsonSchemaFormat | None = Field(default=None, description="With type json_schema.")


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams)."""

    model_config = _STRICT

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="A JSON schema.")
    regex: str | None = Field(default=None, description="A regular expression.")
    choice: list[str] | None = Field(default=None, description="The output is one of these.")
    grammar: str | None = Field(default=None, description="An EBNF grammar (xgrammar's dialect).")
    json_object: bool | None = Field(default=None, description="Any JSON object.")


class StructuredFields(BaseModel):
    """Fields both endpoints share."""

    model_config = _CONFIG

    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema."
    )
    structured_outputs: StructuredOutputsField | None = Field(default=None, description="vLLM's constraints.")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM: a JSON schema.")
    guided_regex: str | None = Field(default=None, description="vLLM: a regular expression.")
    guided_choice: list[str] | None = Field(default=None, description="vLLM: one of these strings.")
    guided_grammar: str | None = Field(default=None, description="vLLM: an EBNF grammar.")
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (as a string) -> bias added to its logit, capped to [-100, 100]."
    )
    min_tokens: int = Field(default=0, ge=0, description="End tokens are masked until this many outputs.")
    # OpenAI fields we do not implement: accepted at their neutral values only (unsupported.py).
    best_of: int | None = Field(default=None, description="Not supported beyond n.")
    service_tier: str | None = Field(default=None, description="Only auto/default.")
    store: bool | None = Field(default=None, description="Not supported: must be false or unset.")
    guided_whitespace_pattern: str | None = Field(default=None, description="Not supported.")
    guided_decoding_backend: str | None = Field(default=None, description="Only xgrammar.")
    metadata: dict[str, Any] | None = Field(default=None, description="Only with store, which is off.")
    # vLLM's fields, accepted at the value that changes nothing (constraints.py).
    skip_special_tokens: bool | None = Field(default=None, description="vLLM: only true.")
    spaces_between_special_tokens: bool | None = Field(default=None, description="vLLM: only true.")
    include_stop_str_in_output: bool | None = Field(default=None, description="vLLM: only false.")
    prompt_logprobs: int | None = Field(default=None, description="vLLM: not supported; use echo.")
    use_beam_search: bool | None = Field(default=None, description="vLLM: only false.")


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$", description="Function name.")
    description: str | None = Field(default=None, description="What the function does.")
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of its arguments.")
    strict: bool | None = Field(default=None, description="Arguments always follow the schema here.")


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str = Field(description="The function to call.")


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"] = Field(description="Only function tools.")
    function: NamedFunction


class ToolFields(BaseModel):
    """Chat-only fields: tools, and the chat fields we do not implement."""

    model_config = _CONFIG

    tools: list[Tool] | None = Field(default=None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="none, auto (default with tools), required, or a named function."
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call.")
    functions: list[dict[str, Any]] | None = Field(default=None, description="Deprecated: use tools.")
    function_call: str | dict[str, Any] | None = Field(default=None, description="Deprecated: tool_choice.")
    audio: dict[str, Any] | None = Field(default=None, description="Not supported.")
    modalities: list[str] | None = Field(default=None, description="Only ['text'].")
    prediction: dict[str, Any] | None = Field(default=None, description="Not supported.")
    web_search_options: dict[str, Any] | None = Field(default=None, description="Not supported.")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        default=None,
        description="How long a reasoning model thinks: handed to the chat template; gpt-oss (harmony) "
        "models default to medium.",
    )
    verbosity: str | None = Field(default=None, description="Not supported.")
    add_generation_prompt: bool | None = Field(default=None, description="vLLM: only true.")
    continue_final_message: bool | None = Field(default=None, description="vLLM: only false.")
