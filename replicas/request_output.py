"""`RequestOutput`: what the offline `LLM.generate` returns for one prompt, a public contract."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied (whole pages)
