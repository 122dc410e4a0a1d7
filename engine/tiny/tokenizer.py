"""The tiny tokenizer: a byte-level BPE trained on the bundled corpus.

Training takes a few tens of milliseconds, so it is simply redone on every call instead of being cached
in module state. `tokenizers`' BPE trainer is deterministic (merge ties are broken by pair order, not by
hash order), so every process gets the identical vocabulary and merges.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
# gpt-oss's harmony markers, as its tokenizer.json has them among its special tokens. The tiny gpt-oss
# tokenizer appends them after the 512 ids, so a tiny gpt-oss is served in the harmony format as the real
# one is (deploy/protocol/harmony).
HARMONY_TOKENS: tuple[str, ...] = (
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


def load_tiny_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The tiny tokenizer wrapped for transformers: eos = pad = `<|endoftext|>`, no BOS, ChatML template.

    A larger `vocab_size` widens it (`widen_backend`) so a benchmark model with a real architecture's
    vocabulary has text for every id of its head, as a real model does."""
    backend = train_tiny_backend()
    if vocab_size != VOCAB_SIZE:
        backend = widen_backend(backend, vocab_size)
    return wrap_backend(backend)


def load_harmony_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with gpt-oss's harmony markers appended as special tokens (ids 512 on), and
    `chat_template` (none by default: the server then renders with tandem's harmony template, as it
    does for a gpt-oss checkpoint that ships none)."""
    backend = train_tiny_backend()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN, *HARMONY_TOKENS],
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=chat_template,
    )


def wrap_backend(backend: Tokenizer, **extra: str) -> PreTrainedTokenizerFast:
    """A `tokenizers` backend with the tiny models' specials and ChatML template, for transformers
    (`extra`: more special tokens, e.g. the demo tokenizer's `unk_token`)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **extra,
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


def widen_backend(backend: Tokenizer, vocab_size: int, seed: int = 0) -> Tokenizer:
    """`backend` with word-like merges appended up to `vocab_size` ids. The first 512 ids, the specials'
    among them, keep their meaning, so models and chat templates written for the tiny tokenizer still
    hold; what a text encodes to changes once the new merges apply.

    Each new token is an ASCII word piece grown by one letter (now and then a digit or punctuation
    mark), with or without the leading-space marker: the mix of a real byte-level BPE vocabulary, which
    is what a structured-output grammar's per-token work and a detokenizer's cost depend on."""
    if vocab_size < VOCAB_SIZE:
        raise ValueError(f"cannot widen the tiny tokenizer to {vocab_size} ids, fewer than its {VOCAB_SIZE}")
    spec = json.loads(backend.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges: list[list[str]] = spec["model"]["merges"]
    for added in spec["added_tokens"]:  # kept at their ids: otherwise they would move past the new ones
        vocab[added["content"]] = added["id"]
    rng = random.Random(seed)
    tails = [t for t in "abcdefghijklmnopqrstuvwxyz" * 9 + "0123456789_-.,:'\"" if t in vocab]
    stems = [t for t in vocab if t.lstrip("Ġ").isascii() and t.lstrip("Ġ").isalpha()]
    next_id = VOCAB_SIZE
    while next_id < vocab_size:
        stem, tail = rng.choice(stems), rng.choice(tails)
        if stem + tail in vocab:
            continue
        vocab[stem + tail] = next_id
        merges.append([stem, tail])
        next_id += 1
        if len(stem) < 12:
            stems.append(stem + tail)
    return Tokenizer.from_str(json.dumps(spec))
