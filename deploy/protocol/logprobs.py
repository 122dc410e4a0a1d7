"""Token ids -> the strings OpenAI logprobs show, with a per-replica cache (vocabularies are finite)."""

from __future__ import annotations

from typing import Any

from tandem.deploy.protocol.jobs import TokenLogprob


class TokenStrings:
    """Decodes single tokens the way a client would read them.

    A token that is only part of a multi-byte character decodes to U+FFFD; that is what OpenAI-style
    servers show too, and `bytes` in the response carries the UTF-8 of the decoded string.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text

    def decode(self, token_ids: list[int]) -> str:
        """A token-id prompt's text, as echo returns it."""
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))

    def prompt_entries(
        self,
        prompt_ids: list[int],
        logprobs: list[float] | None,
        top_logprobs: list[list[tuple[int, float]]] | None,
    ) -> list[TokenLogprob]:
        """A prompt's tokens with their logprobs (position 1 on: `logprobs`); the first has none."""
        first = TokenLogprob(token_id=prompt_ids[0], token=self.text(prompt_ids[0]), logprob=None)
        if logprobs is None:  # the ranks sent none (the request failed first)
            return [first]
        return [first, *self.entries(prompt_ids[1:], logprobs, top_logprobs)]

    def entries(
        self,
        token_ids: list[int],
        logprobs: list[float],
        top_logprobs: list[list[tuple[int, float]]] | None,
    ) -> list[TokenLogprob]:
        entries: list[TokenLogprob] = []
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
            top = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else []
            entries.append(
                TokenLogprob(
                    token_id=token_id,
                    token=self.text(token_id),
                    logprob=float(logprob),
                    top=[(self.text(t), float(lp)) for t, lp in top],
                )
            )
        return entries
