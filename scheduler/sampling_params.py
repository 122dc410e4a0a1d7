"""The per-request sampling parameters of the public API, with validation."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from tandem.scheduler.messages import GrammarSpec, SamplingSpec

MAX_LOGPROBS = 20
LOGIT_BIAS_CAP = 100.0  # OpenAI's range for logit_bias values; larger magnitudes are capped to it


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on the output, named as vLLM's `StructuredOutputsParams`: set exactly one field.

    `json`: a JSON schema (a dict or its JSON text); `json_object`: any JSON object; `regex`: a regular
    expression; `choice`: the output is exactly one of these strings; `grammar`: an EBNF grammar in
    xgrammar's dialect (GBNF-like: `root ::= ...`).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # Not a constraint of its own: a reasoning model's end-of-thinking token id, after which the constraint
    # starts (vLLM's reasoning-aware structured outputs); None constrains from the first token.
    after_token: int | None = None

    def spec(self) -> GrammarSpec:
        """The wire form every rank compiles (a schema as compact JSON, its key order kept: it is the
        order of the output's properties). Raises ValueError unless exactly one field is set."""
        constraints = [f.name for f in fields(self) if f.name != "after_token"]
        chosen = [name for name in constraints if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {chosen or 'none'}"
            )
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            return self._spec("json_schema", json.dumps(schema, separators=(",", ":")))
        if self.regex is not None:
            return self._spec("regex", self.regex)
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return self._spec("choice", json.dumps(list(self.choice)))
        if self.grammar is not None:
            return self._spec("grammar", self.grammar)
        return self._spec("json_object")

    def _spec(self, kind: str, text: str = "") -> GrammarSpec:
        return GrammarSpec(kind, text, self.after_token)


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
    # Added after the fixed §6 fields: EOS and stop_token_ids are masked until this many outputs.
    min_tokens: int = 0
    # token id -> value added to its logit (OpenAI's logit_bias; values beyond +-100 are capped).
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: the log-prob of every prompt token (the first has none, RequestOutput.prompt_logprobs), with
    # this many top alternatives at each position. Such requests skip the prefix cache (a cached prefix
    # has no logits), as in vLLM.
    prompt_logprobs: int | None = None
    # With the engine's `speculative_config`: False keeps this request's rows plain (no drafts), e.g. for
    # a latency-critical request in a batch where drafting only costs. Without speculation it does nothing.
    speculative: bool = True

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
            (
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (self.seed is None or isinstance(self.seed, int), "seed must be an int"),
            (isinstance(self.speculative, bool), "speculative must be a bool"),
            (
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                "min_tokens must be an int in [0, max_tokens]",
            ),
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
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not isinstance(bias, (int, float)) or bias != bias:
                raise ValueError(f"logit_bias values must be numbers, got {bias!r}")
        if self.structured_outputs is not None:
            self.structured_outputs.spec()

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


def to_spec(params: SamplingParams) -> SamplingSpec:
    """The scheduler's wire form of `params` (stop strings stay with the detokenizer)."""
    own = {"stop", "stop_token_ids", "logit_bias", "structured_outputs"}
    values: dict[str, Any] = {f.name: getattr(params, f.name) for f in fields(SamplingParams)}
    values = {n: v for n, v in values.items() if n not in own}
    bias = tuple(
        (int(t), max(-LOGIT_BIAS_CAP, min(LOGIT_BIAS_CAP, float(b))))
        for t, b in sorted((params.logit_bias or {}).items())
    )
    grammar = params.structured_outputs.spec() if params.structured_outputs is not None else None
    return SamplingSpec(
        **values, stop_token_ids=tuple(params.stop_token_ids or ()), logit_bias=bias, grammar=grammar
    )


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the first of `stops` begins in `text`, None if none is in it."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
