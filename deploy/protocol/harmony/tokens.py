"""The harmony special tokens of a model's own tokenizer, resolved once to ids.

Replies are read on token ids, not on text: the detokenizer drops special tokens from the text, and a
model may write `<|channel|>` as plain characters inside a message, which must stay text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})  # config.json model_type of the models trained on harmony

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
REQUIRED = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)


def uses_harmony(model_type: str | None) -> bool:
    return model_type in HARMONY_MODEL_TYPES


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of the harmony markers, and the `tokenizers` backend that decodes the text between them."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int
    backend: Any  # tokenizers.Tokenizer

    @classmethod
    def of(cls, tokenizer: Any) -> HarmonyTokens:
        """The tokenizer's harmony ids; a ValueError naming the markers it lacks (a tokenizer that is not
        gpt-oss's cannot be read as harmony)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("the harmony format needs a fast tokenizer (the model's tokenizer.json)")
        vocab = backend.get_vocab(with_added_tokens=True)
        missing = [t for t in REQUIRED if t not in vocab]
        if missing:
            raise ValueError(
                f"the model's tokenizer lacks the harmony special tokens {missing}; a gpt-oss model "
                "needs gpt-oss's own tokenizer.json"
            )
        start, end, message, channel, constrain, return_, call = (int(vocab[t]) for t in REQUIRED)
        return cls(start, end, message, channel, constrain, return_, call, backend)

    @property
    def stops(self) -> tuple[int, int]:
        """The tokens that end a reply: `<|return|>` after the final answer, `<|call|>` after a tool call."""
        return self.return_, self.call
