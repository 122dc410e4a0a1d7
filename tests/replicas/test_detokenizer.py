"""Incremental detokenization: pieces add up to the full decode, and stop strings cut across tokens."""

from __future__ import annotations

import pytest

from tandem.engine.tiny import load_tiny_tokenizer
from tandem.replicas.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld! 🦊 foxes jump; the end is near. 日本語 too."


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tiny_tokenizer()


def test_pieces_add_up_to_the_full_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Prompt: "))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) + detok.flush() == TEXT
    assert all("\ufffd" not in p for p in pieces)  # partial UTF-8 is held back, never emitted
    assert len(ids) > len(TEXT.split())  # byte-level BPE: the emoji and CJK span several tokens


@pytest.mark.parametrize("stop", ["wörld", "d! 🦊", "end is", "日本"])
def test_stop_string_across_tokens(tokenizer, stop: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[], stop=["never-there", stop])
    released = ""
    for t in ids:
        released += detok.add(t)
        if detok.stopped:
            break
    assert detok.stopped
    assert released == TEXT[: TEXT.index(stop)]
    assert detok.add(ids[-1]) == "" and detok.flush() == ""  # nothing after a stop


def test_text_that_may_start_a_stop_is_held_then_released(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[], stop=["jump!"])  # "jump;" is not a stop
    out = "".join(detok.add(t) for t in ids) + detok.flush()
    assert out == TEXT and not detok.stopped
