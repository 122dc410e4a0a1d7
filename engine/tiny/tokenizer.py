"""The tiny tokenizer: a byte-level BPE trained on the bundled corpus.

Training takes a few tens of milliseconds, so it is simply redone on every call instead of being cached
in module state. `tokenizers`' BPE trainer is deterministic (merge ties are broken by pair order, not by
hash order), so every process gets the identical vocabulary and merges.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
# Total vocabulary, specials included. The specials are appended *after* training so they get the top ids
# (509, 510, 511) as in real Qwen/Llama vocabularies; an engine that silently assumes pad/eos == 0 fails.
VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 2048

_HERE = Path(__file__).resolve().parent


def corpus_text() -> str:
    """The bundled training text (original prose, dialogue, code and numbers)."""
    return (_HERE / "corpus.txt").read_text(encoding="utf-8")


def chat_template() -> str:
    """The ChatML-style Jinja chat template shipped with every tiny model."""
    return (_HERE / "chat_template.jinja").read_text(encoding="utf-8")


def train_tiny_backend() -> Tokenizer:
    """Train the raw `tokenizers.Tokenizer` (byte-level BPE, `VOCAB_SIZE` ids including specials)."""
    tok = Tokenizer(models.BPE())
    # No normalizer: byte-level BPE then round-trips any UTF-8 text (emoji, CJK, odd whitespace) exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets covering the leading space, like GPT-2/Qwen; no BOS is added.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        # All 256 byte symbols are always in the vocabulary, so no input is ever out of vocabulary.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One sequence (not lines) so that whitespace runs such as "\n\n" can become merges.
    tok.train_from_iterator([corpus_text()], trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} ids, expected {VOCAB_SIZE}")
    return tok


def load_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer wrapped for transformers: eos = pad = `<|endoftext|>`, no BOS, ChatML template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_backend(),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        # The default cleanup rewrites " ," to "," on decode, which breaks exact round-trips.
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=chat_template(),
    )


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """Ids of the special tokens, keyed by their text."""
    ids: dict[str, int] = {}
    for text in SPECIAL_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(text)
        if not isinstance(tid, int):
            raise RuntimeError(f"special token {text!r} is missing from the tiny tokenizer")
        ids[text] = tid
    return ids
