"""Incremental detokenization with the `tokenizers` library's `DecodeStream`, and stop strings.

Each token costs O(1): `DecodeStream` keeps only the few ids of a character still being assembled
(multi-byte UTF-8 split across byte-level tokens, byte-fallback `<0x..>` tokens). Ids the tokenizer
does not know (a model's LM head is often padded past its tokenizer) are dropped before the stream sees
them: fed in, they would stay in its buffer and make every later step decode a growing window.

Stop strings are matched on the new text plus the text held back since the last release, which is
never longer than the longest stop string: released text never ends with a proper prefix of a stop.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from tandem.scheduler.sampling_params import first_stop, partial_stop_len

# Prompt ids that seed a request's stream, so its first output token decodes in context (a
# SentencePiece "▁word" keeps its space after a prompt, as it would in the full text).
PROMPT_CONTEXT_IDS = 4
# A UTF-8 character is at most 4 bytes, so at most 3 ids (byte-level or byte-fallback tokens, one byte
# each at worst) of an unfinished one end a prompt, and as many may open its context window.
MAX_PARTIAL_IDS = 3
_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class TokenDecoder:
    """What every request's detokenizer shares: the fast tokenizer and the ids it can decode."""

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(
                f"{type(tokenizer).__name__} is not a fast tokenizer; tandem needs the `tokenizers` "
                "backend (a tokenizer.json) for incremental detokenization"
            )
        self.backend = backend
        ids = backend.get_vocab(with_added_tokens=True).values()
        self._known = bytearray(max(ids, default=-1) + 1)
        for token_id in ids:
            self._known[token_id] = 1

    def knows(self, token_id: int) -> bool:
        return 0 <= token_id < len(self._known) and self._known[token_id] == 1


class IncrementalDetokenizer:
    """Turns one request's output ids into text pieces as they arrive, cutting at the first stop string.

    With stop strings, text that could still be the start of one is held back until it is not.
    """

    def __init__(
        self,
        decoder: TokenDecoder,
        prompt_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        context, partial = _prompt_seed(decoder, [t for t in prompt_ids if decoder.knows(t)])
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        for token_id in partial:
            # The prompt ends inside a character: its bytes wait in the stream (nothing is released
            # yet), and the output token that completes it releases the whole character.
            self._stream.step(decoder.backend, token_id)
        self._stop = list(stop or ())
        self._held = ""
        self.text = ""  # everything released so far
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly released text ("" if none yet, or after a stop)."""
        if self.stopped or not self._decoder.knows(token_id):
            return ""
        piece = self._stream.step(self._decoder.backend, token_id)
        if not piece:
            return ""
        return self._release(piece)

    def flush(self) -> str:
        """At the end of a request: release anything held back."""
        out, self._held = ("" if self.stopped else self._held), ""
        self.text += out
        return out

    def _release(self, new: str) -> str:
        if not self._stop:
            self.text += new
            return new
        pending = self._held + new
        cut = first_stop(pending, self._stop)
        if cut is not None:
            self.stopped = True
            self._held = ""
            self.text += pending[:cut]
            return pending[:cut]
        keep = partial_stop_len(pending, self._stop)
        out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out


def _prompt_seed(decoder: TokenDecoder, prompt_ids: list[int]) -> tuple[list[int], list[int]]:
    """(context, partial): the stream's seed, a few prompt ids that decode cleanly (no unfinished
    character at either end, as vLLM seeds its stream), and the prompt's last ids after it when those end
    inside a character. Seeded with such ids as context, the stream would count their bytes as already
    released and hand the prompt's text out again with the first output token."""
    tail = prompt_ids[-(PROMPT_CONTEXT_IDS + 2 * MAX_PARTIAL_IDS) :]
    # Usually the first try decodes cleanly: one decode of a few ids per request.
    for cut in range(len(tail), max(len(tail) - MAX_PARTIAL_IDS, 0) - 1, -1):
        first = max(cut - PROMPT_CONTEXT_IDS, 0)
        for start in range(first, max(first - MAX_PARTIAL_IDS, 0) - 1, -1):
            text = decoder.backend.decode(tail[start:cut], skip_special_tokens=False)
            if not text.endswith(_REPLACEMENT) and not text.startswith(_REPLACEMENT):
                return tail[start:cut], tail[cut:]
    # Text that really holds U+FFFD (or ids that decode to nothing): the last ids, as they are.
    return prompt_ids[-PROMPT_CONTEXT_IDS:], []
