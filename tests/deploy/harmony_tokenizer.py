"""A tiny tokenizer with gpt-oss's harmony special tokens, for the harmony tests.

The tiny byte-level BPE (engine/tiny) with the harmony markers added as special tokens, as gpt-oss's
tokenizer.json has them, and tandem's harmony template as its chat template.
"""

from __future__ import annotations

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from tandem.deploy.protocol.harmony.template import HARMONY_TEMPLATE
from tandem.engine.tiny.tokenizer import train_tiny_backend

HARMONY_SPECIALS = (
    "<|startoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
    "<|endofprompt|>",
)


def harmony_tokenizer(chat_template: str | None = HARMONY_TEMPLATE) -> PreTrainedTokenizerFast:
    backend = train_tiny_backend()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(HARMONY_SPECIALS),
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
    )


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """The ids of a reply as the model writes it (markers as their single special-token ids)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
