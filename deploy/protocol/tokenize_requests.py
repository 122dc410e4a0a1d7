"""vLLM's `POST /tokenize` and `POST /detokenize` bodies, with its field names and defaults.

`/tokenize` takes a `prompt` (tokenized as a completion's prompt is, special tokens added by default) or
chat `messages` (rendered with the server's chat template, as a chat completion's prompt is, the generation
prompt added by default). Unknown keys are a 400, as on the generation routes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.deploy.protocol.requests import ChatMessage, TokenId, checked_template_kwargs
from tandem.deploy.protocol.structured_fields import Tool

_BODY_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


class TokenizeCompletionRequest(BaseModel):
    model_config = _BODY_CONFIG

    model: str | None = Field(default=None, description="Served model or adapter name; unset: the model.")
    prompt: str = Field(description="The text to tokenize.")
    add_special_tokens: bool = Field(default=True, description="Add the tokenizer's special tokens (BOS).")
    return_token_strs: bool | None = Field(default=False, description="Also return each token's text.")


class TokenizeChatRequest(BaseModel):
    model_config = _BODY_CONFIG

    model: str | None = Field(default=None, description="Served model or adapter name; unset: the model.")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation to render.")
    add_generation_prompt: bool = Field(default=True, description="End with the assistant's turn opening.")
    continue_final_message: bool = Field(
        default=False, description="Leave the last message open (not with add_generation_prompt)."
    )
    add_special_tokens: bool = Field(
        default=False, description="Add special tokens on top of the template's (it writes its own BOS)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Variables for the chat template, as on chat completions."
    )
    tools: list[Tool] | None = Field(default=None, description="Tools shown to the chat template.")
    return_token_strs: bool | None = Field(default=False, description="Also return each token's text.")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_stays_the_servers(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return checked_template_kwargs(kwargs)


class DetokenizeRequest(BaseModel):
    model_config = _BODY_CONFIG

    model: str | None = Field(default=None, description="Served model or adapter name; unset: the model.")
    tokens: list[TokenId] = Field(description="The token ids to turn into text.")
