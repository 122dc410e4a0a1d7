"""Incremental detokenization: pieces add up to `tokenizer.decode`, multi-byte characters and byte-fallback
tokens come out whole, stop strings cut across tokens, and ids the tokenizer does not know give no text."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tandem.engine.tiny import load_tiny_tokenizer
from tandem.replicas.detokenizer import IncrementalDetokenizer, TokenDecoder

TEXT = "Héllo wörld! 🦊 foxes jump; the end is near. 日本語 too."


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return load_tiny_tokenizer()


@pytest.fixture(scope="module")
def decoder(tokenizer: PreTrainedTokenizerFast) -> TokenDecoder:
    return TokenDecoder(tokenizer)


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2, Mistral): ASCII letters as tokens, everything else as
    `<0xNN>` byte tokens, `▁` for spaces."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for ch in "▁abcdefghijklmnopqrstuvwxyzHT!.;":
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


def stream(decoder: TokenDecoder, ids: list[int], stop: list[str] | None = None) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(decoder, prompt_ids=[], stop=stop)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces, detok.text


def test_pieces_add_up_to_the_full_decode(tokenizer: PreTrainedTokenizerFast, decoder: TokenDecoder) -> None:
    ids = tokenizer.encode(TEXT)
    pieces, text = stream(decoder, ids)
    assert "".join(pieces) == text == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # partial UTF-8 is held back, never emitted
    # Byte-level BPE splits the emoji and the CJK characters over several tokens: some steps give no text.
    assert pieces.count("") > 1


def test_prompt_context_does_not_change_the_text(
    tokenizer: PreTrainedTokenizerFast, decoder: TokenDecoder
) -> None:
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(decoder, prompt_ids=tokenizer.encode("Prompt: é"))
    assert "".join(detok.add(t) for t in ids) + detok.flush() == TEXT


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_a_prompt_ending_inside_a_character_gives_no_prompt_text(byte_fallback: bool) -> None:
    """A token-id prompt split inside a multi-byte character (byte-level BPE, or SentencePiece's byte
    tokens): the output is the text the output ids add, the character they complete first, and never the
    prompt's own text before it."""
    tok = byte_fallback_tokenizer() if byte_fallback else load_tiny_tokenizer()
    decoder = TokenDecoder(tok)
    text = "Hi 🦊 and 日本 ok" if not byte_fallback else "Hi 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    split_inside = 0
    for cut in range(1, len(ids)):
        detok = IncrementalDetokenizer(decoder, prompt_ids=ids[:cut])
        pieces = [detok.add(t) for t in ids[cut:]] + [detok.flush()]
        output = "".join(pieces)
        # The prompt's text up to its last whole character: the output is the rest, the character the
        # output ids complete first.
        whole = cut
        while tok.decode(ids[:whole]).endswith("\ufffd"):
            whole -= 1
        split_inside += whole < cut
        assert output == full[len(tok.decode(ids[:whole])) :], (cut, output)
        assert "\ufffd" not in output
    assert split_inside >= 3  # the emoji and the CJK characters were cut inside, more than once


def test_byte_fallback_tokens_decode_whole() -> None:
    tok = byte_fallback_tokenizer()
    text = "Hé▁ist▁日本!"  # é and the CJK characters exist only as byte tokens
    ids = tok.encode("Hé ist 日本!")
    assert sum(1 for t in ids if t < 256) == 8  # 2 bytes for é, 3 for each CJK character
    pieces, released = stream(TokenDecoder(tok), ids)
    assert released == tok.decode(ids) == text.replace("▁", " ")
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stop", ["wörld", "d! 🦊", "end is", "日本"])
def test_stop_string_across_tokens(
    tokenizer: PreTrainedTokenizerFast, decoder: TokenDecoder, stop: str
) -> None:
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(decoder, prompt_ids=[], stop=["never-there", stop])
    released = ""
    for t in ids:
        released += detok.add(t)
        if detok.stopped:
            break
    assert detok.stopped
    assert released == TEXT[: TEXT.index(stop)]
    assert detok.add(ids[-1]) == "" and detok.flush() == ""  # nothing after a stop


def test_text_that_may_start_a_stop_is_held_then_released(
    tokenizer: PreTrainedTokenizerFast, decoder: TokenDecoder
) -> None:
    ids = tokenizer.encode(TEXT)
    pieces, text = stream(decoder, ids, stop=["jump!"])  # "jump;" is not a stop
    assert text == TEXT
    held = pieces[next(i for i in range(len(ids)) if tokenizer.decode(ids[: i + 1]).endswith("jump"))]
    assert not held.endswith("jump")  # held back while "jump!" was still possible


def test_unknown_ids_give_no_text_and_do_not_disturb_the_rest(
    tokenizer: PreTrainedTokenizerFast, decoder: TokenDecoder
) -> None:
    # A padded LM head (Qwen's 151,936 rows over a ~151,670-id tokenizer) samples ids past the tokenizer.
    ids = tokenizer.encode(TEXT)
    unknown = list(range(len(tokenizer), len(tokenizer) + 2000))
    mixed = ids[:3] + unknown + ids[3:] + [10**7, -1]
    assert not any(decoder.knows(t) for t in [*unknown, 10**7, -1])
    pieces, text = stream(decoder, mixed)
    assert text == TEXT
    assert all(p == "" for p in pieces[3 : 3 + len(unknown)])


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerFast, decoder: TokenDecoder) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer.encode("one two")
    _, text = stream(decoder, [*ids, eos])
    assert text == tokenizer.decode([*ids, eos], skip_special_tokens=True) == "one two"
