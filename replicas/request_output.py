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
    # With SamplingParams(prompt_logprobs=n), as vLLM's field of that name: one entry per prompt token, the
    # first None (nothing precedes it), and per token its top n alternatives (the first again None).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def add_prompt_logprobs(
        self, logprobs: list[float] | None, top: list[list[tuple[int, float]]] | None
    ) -> None:
        """The prompt log-probs a request's first output carries (position 1 on)."""
        if logprobs is not None:
            self.prompt_logprobs = [None, *logprobs]
        if top is not None:
            self.prompt_top_logprobs = [None, *top]
