"""A tiny tokenizer with gpt-oss's harmony special tokens, for the harmony tests.

The tiny gpt-oss tokenizer (engine/tiny: the byte-level BPE with the harmony markers added as special
tokens, as gpt-oss's tokenizer.json has them), with tandem's harmony template as its chat template.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from tandem.deploy.protocol.harmony.template import HARMONY_TEMPLATE
from tandem.engine.tiny.tokenizer import load_harmony_tokenizer


def harmony_tokenizer(chat_template: str | None = HARMONY_TEMPLATE) -> PreTrainedTokenizerFast:
    return load_harmony_tokenizer(chat_template)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """The ids of a reply as the model writes it (markers as their single special-token ids)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
