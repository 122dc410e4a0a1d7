"""The per-request sampling parameters of the public API, with validation."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one completion. Temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and its allowed range."""
        checks: list[tuple[bool, str]] = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an int >= 1"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (self.seed is None or isinstance(self.seed, int), "seed must be an int"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self._value_of(message)}")
        for token in self.stop_token_ids or []:
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {token!r}")
        for text in self.stop_strings:
            if not text:
                raise ValueError("stop strings must be non-empty")

    def _value_of(self, message: str) -> object:
        return getattr(self, message.split()[0])

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
