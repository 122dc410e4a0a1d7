"""Cheap bounds on one request, checked on the parsed body before any tokenizing or admission.

A request's cost grows with its choices (prompts x `n`) and its text; both are bounded here so one body
cannot tie up a replica's tokenizer, memory or every running slot. The prompt-text bound is a
character count derived from the context length: a token spans at most a few dozen characters in any
real vocabulary, so a text longer than `max_model_len x prompt_chars_per_token` cannot fit in the
context, and saying so needs no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.deploy.protocol.errors import OpenAIError, invalid_request
from tandem.deploy.protocol.jobs import GenerateJob

DEFAULT_MAX_CHOICES = 512


@dataclass(frozen=True)
class RequestLimits:
    max_choices: int = DEFAULT_MAX_CHOICES
    max_prompt_chars: int | None = None  # None: no bound (unknown context length)


def prompt_chars_bound(max_model_len: int, chars_per_token: int) -> int:
    return max_model_len * chars_per_token


def check_job(job: GenerateJob, limits: RequestLimits) -> None:
    """Raise a 400 for a job past the limits; costs one pass over the prompt lengths."""
    choices = job.num_choices
    if choices > limits.max_choices:
        raise invalid_request(
            f"this request asks for {choices} choices (prompts x n), more than this server's limit of "
            f"{limits.max_choices} (max_choices_per_request)",
            param="n",
        )
    if limits.max_prompt_chars is None:
        return
    if job.messages is not None:
        chars = sum(_message_chars(m) for m in job.messages)
        if chars > limits.max_prompt_chars:
            raise _too_long(chars, limits.max_prompt_chars, "messages")
        return
    prompts = job.prompts or []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
            raise _too_long(
                len(prompt), limits.max_prompt_chars, "prompt" if len(prompts) == 1 else f"prompt.{i}"
            )


def _message_chars(message: dict[str, object]) -> int:
    content = message.get("content")
    return len(content) if isinstance(content, str) else 0


def _too_long(chars: int, bound: int, param: str) -> OpenAIError:
    return invalid_request(
        f"the prompt has {chars} characters, more than could fit in the context length ({bound} "
        "characters at most)",
        param=param,
        code="context_length_exceeded",
    )
