"""The replica's tokenizer and the server's chat template: text and chats to token ids, ids to text.

The generation path tokenizes its prompts here, and vLLM's `/tokenize`, `/detokenize` and
`/tokenizer_info` answer from here too, so a client's count of a prompt's tokens is the count the server
generates from. Every failure a client caused is a `Rejected` naming the field.
"""

from __future__ import annotations

from typing import Any

from tandem.deploy.protocol.jobs import JobRejected
from tandem.deploy.protocol.templates import forbidden_template_kwargs


class Rejected(Exception):
    """A job the model cannot take; becomes a `JobRejected` event (a 400)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.event = JobRejected(message, param, code)


class Tokenization:
    """Not thread-safe, as the tokenizer is not documented to be: one thread uses it at a time."""

    def __init__(self, tokenizer: Any, chat_template: str | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: the tokenizer's own
        self.vocab_size = vocab_size

    def encode(self, text: str, param: str, *, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # JSON may escape a lone surrogate ("\ud83e"): a Python str, but not Unicode text, and the
            # tokenizer raises a TypeError on it. That is the client's 400, not our 500.
            raise Rejected(
                f"the text is not valid Unicode ({exc.reason} at character {exc.start})", param
            ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The chat rendered with the server's template, tokenized. The template writes any BOS itself,
        so special tokens are not added again unless asked for."""
        extra = dict(template_kwargs or {})
        clash = forbidden_template_kwargs(extra)
        if clash:  # the protocol refuses these already; a job built elsewhere must not get through
            raise Rejected(f"chat_template_kwargs may not set {clash}", "chat_template_kwargs")
        if add_generation_prompt and continue_final_message:
            raise Rejected(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **extra,
            )
        except Exception as exc:  # a template raising on odd input is the client's 400, not our 500
            raise Rejected(f"the chat template failed on these messages: {exc}", "messages") from None
        ids = self.encode(str(text), "messages", add_special_tokens=add_special_tokens)
        if not ids:
            raise Rejected("the rendered chat prompt is empty", "messages")
        return ids

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise Rejected(f"token ids must lie in [0, {self.vocab_size}), got {bad[:3]}", param)

    def decode(self, ids: list[int]) -> str:
        self.check_ids(ids, "tokens")
        return str(self.tokenizer.decode(ids))

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each token's own text (its vocabulary entry), as vLLM's `return_token_strs` gives it; "" for an
        id of the model's padded vocabulary that the tokenizer does not have."""
        return [t if isinstance(t, str) else "" for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def info(self, max_model_len: int) -> dict[str, Any]:
        """vLLM's `/tokenizer_info`: the tokenizer's class, special tokens and the server's chat template,
        which lm-eval's remote tokenizer reads (`eos_token`, `bos_token`, `chat_template`)."""
        tok = self.tokenizer
        template = self.chat_template if self.chat_template is not None else tok.chat_template
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": template,
            "model_max_length": max_model_len,
            "vocab_size": self.vocab_size,
        }
