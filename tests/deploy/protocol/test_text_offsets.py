"""Completion `text_offset`s do not depend on how a choice's tokens were grouped into deltas."""

from __future__ import annotations

from tandem.deploy.protocol.jobs import ChoiceDelta, TokenLogprob
from tandem.deploy.protocol.responses import ChoiceResult, CompletionFormat

# A character split over two byte tokens: the detokenizer holds its first byte back, so the text of a
# delta holding only that token is empty, and whole once the second byte arrives.
TOKENS = [("<0xE2>", "", 1), ("<0x82>", "", 2), ("<0xAC>", "€", 3), ("ab", "ab", 4), ("c", "c", 5)]


def _entry(piece: str, token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, token=piece, logprob=-1.0)


def _deltas(groups: list[int]) -> list[ChoiceDelta]:
    deltas, start = [], 0
    for size in groups:
        part = TOKENS[start : start + size]
        start += size
        deltas.append(
            ChoiceDelta(
                index=0,
                text="".join(text for _, text, _ in part),
                token_ids=[t for _, _, t in part],
                logprobs=[_entry(piece, t) for piece, _, t in part],
                finish_reason="length" if start == len(TOKENS) else None,
            )
        )
    return deltas


def _collected(groups: list[int]) -> list[int]:
    result = ChoiceResult(index=0)
    for delta in _deltas(groups):
        result.add(delta)
    assert result.text == "€abc"
    return result.text_offsets


def _streamed(groups: list[int]) -> list[int]:
    fmt = CompletionFormat("cmpl-1", "m", 0)
    offsets: list[int] = []
    for delta in _deltas(groups):
        chunk = fmt.chunk(delta)
        if chunk is not None and chunk["choices"][0]["logprobs"] is not None:
            offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    return offsets


def test_offsets_are_the_same_for_every_grouping_streamed_or_not() -> None:
    groupings = [[5], [1, 1, 1, 1, 1], [1, 4], [2, 3], [3, 1, 1]]
    expected = [0, 6, 12, 18, 20]  # the running sum of the token strings, as vLLM counts them
    for groups in groupings:
        assert _collected(groups) == expected, groups
        assert _streamed(groups) == expected, groups
