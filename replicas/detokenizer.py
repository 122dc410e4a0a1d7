"""Incremental detokenization with stop strings, matched on text across token boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class IncrementalDetokenizer:
    """Turns one request's output ids into text pieces as they arrive.

    Decoding a window of recent tokens (not single tokens) keeps multi-token characters and
    byte-level merges right; text ending in U+FFFD waits for the rest of its bytes. With stop
    strings, text that could still be the start of a stop string is held back until it is not.
    """

    tokenizer: Any
    prompt_ids: list[int]
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    text: str = ""  # everything released so far
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _held: str = ""
    stopped: bool = False

    def __post_init__(self) -> None:
        # Start from the prompt's tail so the first output token decodes in context.
        self._ids = list(self.prompt_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly released text ("" if held back or after a stop)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(new)

    def flush(self) -> str:
        """At the end of a request: release anything held back."""
        out, self._held = ("" if self.stopped else self._held), ""
        self.text += out
        return out

    def _release(self, new: str) -> str:
        if not self.stop:
            self.text += new
            return new
        pending = self._held + new
        cut = _first_stop(pending, self.stop)
        if cut is not None:
            self.stopped = True
            self._held = ""
            self.text += pending[:cut]
            return pending[:cut]
        keep = _partial_stop_len(pending, self.stop)
        out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
