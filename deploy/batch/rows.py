"""A processor row's request (`prompt` or `messages`, plus `sampling_params`) as a `GenerateJob`, and the
output columns every row gets back.

A row that cannot become a job raises `RowError`; its message goes to the row's `error` column. Arrow gives
every row of a struct column every key of the column, with None where a row had none, so a None sampling
parameter means "the default" here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pydantic import ValidationError

from tandem.deploy.protocol.errors import from_validation_errors
from tandem.deploy.protocol.jobs import GenerateJob
from tandem.deploy.protocol.requests import ChatMessage
from tandem.scheduler.sampling_params import SamplingParams, StructuredOutputs

INPUT_COLUMNS = ("prompt", "messages", "sampling_params")
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class RowError(ValueError):
    """A row whose request cannot run; the message names the field."""


def row_job(row: dict[str, Any], request_id: str) -> GenerateJob:
    """The job of one row; raises RowError naming what is wrong with it."""
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise RowError("a row needs exactly one of `prompt` (text or token ids) and `messages`")
    sampling = sampling_params(row.get("sampling_params"))
    common: dict[str, Any] = {
        "request_id": request_id,
        "sampling": sampling,
        "max_tokens": sampling.max_tokens,
        # What a refused or failed constraint names.
        "structured_param": "sampling_params.structured_outputs" if sampling.structured_outputs else None,
    }
    if prompt is not None:
        return GenerateJob(prompts=[_prompt(prompt)], **common)
    return GenerateJob(messages=_messages(messages), **common)


def sampling_params(values: Any) -> SamplingParams:
    """`sampling_params` as the offline API's SamplingParams (vLLM's names), validated."""
    if values is None:
        return SamplingParams()
    if not isinstance(values, dict):
        raise RowError(f"sampling_params must be a dict, got {type(values).__name__}")
    given = {k: v for k, v in values.items() if v is not None}
    unknown = sorted(set(given) - _SAMPLING_FIELDS)
    if unknown:
        raise RowError(f"sampling_params: unknown field(s) {', '.join(unknown)}")
    if "logprobs" in given:  # refused rather than dropped: a row has no column for them
        raise RowError("sampling_params: logprobs are not returned as columns; `tandem batch` returns them")
    if isinstance(given.get("structured_outputs"), dict):
        given["structured_outputs"] = _structured(given["structured_outputs"])
    if isinstance(given.get("logit_bias"), dict):  # Arrow turns int keys into struct field names
        given["logit_bias"] = _logit_bias(given["logit_bias"])
    try:
        params = SamplingParams(**given)
        params.validate()
    except (TypeError, ValueError) as exc:
        raise RowError(f"sampling_params: {exc}") from None
    return params


def _structured(values: dict[str, Any]) -> StructuredOutputs:
    try:
        return StructuredOutputs(**{k: v for k, v in values.items() if v is not None})
    except TypeError as exc:
        raise RowError(f"sampling_params.structured_outputs: {exc}") from None


def _logit_bias(values: dict[Any, Any]) -> dict[int, float]:
    try:
        return {int(k): v for k, v in values.items() if v is not None}
    except ValueError:
        raise RowError("sampling_params.logit_bias keys must be token ids") from None


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise RowError("prompt must be a string or a list of token ids")


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RowError("messages must be a non-empty list of {role, content} dicts")
    parsed = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):  # Arrow's struct fill: keys another message had
            message = {k: v for k, v in message.items() if v is not None}
        try:
            parsed.append(ChatMessage.model_validate(message).to_template_dict())
        except ValidationError as exc:
            raise RowError(f"messages.{i}: {from_validation_errors(exc.errors()).message}") from None
    return parsed


@dataclass
class RowOutput:
    """What one row gets back. `error` is None unless the row could not run."""

    generated_text: str = ""
    generated_tokens: list[int] = field(default_factory=list)
    num_input_tokens: int = 0
    finish_reason: str | None = None
    time_taken_llm: float = 0.0
    error: str | None = None
    reasoning_content: str | None = None  # a harmony (gpt-oss) chat's analysis channel; None for others


# The output columns with fixed types, so every block has the same schema whatever its rows hold.
OUTPUT_SCHEMA = pa.schema(
    [
        ("generated_text", pa.string()),
        ("reasoning_content", pa.string()),
        ("generated_tokens", pa.list_(pa.int64())),
        ("num_input_tokens", pa.int64()),
        ("num_generated_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("time_taken_llm", pa.float64()),
        ("error", pa.string()),
    ]
)


def with_outputs(batch: pa.Table, outputs: list[RowOutput]) -> pa.Table:
    """The batch with the output columns set (replacing any of the same name), rows in order."""
    values = {
        "generated_text": [o.generated_text for o in outputs],
        "reasoning_content": [o.reasoning_content for o in outputs],
        "generated_tokens": [o.generated_tokens for o in outputs],
        "num_input_tokens": [o.num_input_tokens for o in outputs],
        "num_generated_tokens": [len(o.generated_tokens) for o in outputs],
        "finish_reason": [o.finish_reason for o in outputs],
        "time_taken_llm": [o.time_taken_llm for o in outputs],
        "error": [o.error for o in outputs],
    }
    for column in OUTPUT_SCHEMA:
        array = pa.array(values[column.name], type=column.type)
        index = batch.schema.get_field_index(column.name)
        if index >= 0:
            batch = batch.set_column(index, column.name, array)
        else:
            batch = batch.append_column(column.name, array)
    return batch
