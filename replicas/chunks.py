"""What `LLMReplica.generate` yields: one chunk per group of new tokens of one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationChunk:
    """New output of one request since the previous chunk.

    `text` is detokenized incrementally with stop strings applied (text from a stop string on is never
    sent). The last chunk has `finish_reason` set: "stop", "length", "abort", or "error" with `error`
    saying why (for example, a rank died).
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None  # one per token in token_ids, when requested
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (token id, logprob), best first
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative, including this chunk
    cached_tokens: int | None = None  # on the first chunk: prompt tokens the prefix cache supplied
    # On the first chunk, when the sampling asked for prompt_logprobs: each prompt token's log-prob from
    # the second on, and (prompt_logprobs > 0) the top alternatives at each of those positions.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
