"""Messages into the scheduler (add, abort) and the token outputs it emits, as msgspec structs so the
same types cross the replica <-> rank-0 channel without conversion."""

from __future__ import annotations

import msgspec


class GrammarSpec(msgspec.Struct, frozen=True):
    """A structured-output constraint as every rank compiles it: the same text gives the same matcher.

    `kind` is "json_schema" (text: the schema as canonical JSON), "json_object" (text unused),
    "regex", "choice" (text: a JSON list of strings) or "grammar" (text: xgrammar EBNF).
    """

    kind: str
    text: str = ""
    after_token: int | None = None  # the constraint starts after this token (a reasoning model's </think>)


class SamplingSpec(msgspec.Struct, frozen=True):
    """The wire form of SamplingParams that the scheduler needs (stop strings stay in the replica)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), bias already capped to +-100
    grammar: GrammarSpec | None = None
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None: no prompt log-probs
    speculative: bool = True  # False: this request never drafts (engine speculation stays on for others)


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter to run a request with, as vLLM names it: `LoRARequest(lora_name, lora_int_id,
    lora_path)`, with `lora_path` a local PEFT adapter directory. The id identifies the adapter to the
    ranks (their caches and slots are keyed by it): one id, one adapter; ids start at 1."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    rid: int
    prompt_ids: list[int]
    sampling: SamplingSpec
    lora: LoRARequest | None = None  # None: the base model


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    rid: int


class LoadLora(msgspec.Struct, frozen=True, tag=True):
    """Read an adapter into every rank's host cache now, before requests name it."""

    lora: LoRARequest


class UnloadLora(msgspec.Struct, frozen=True, tag=True):
    """Drop an adapter from the ranks' caches and slots, once no running request uses it."""

    lora_int_id: int


SchedulerMsg = AddRequest | AbortRequest | LoadLora | UnloadLora


class TokenOutput(msgspec.Struct, frozen=True):
    """One new token of one request; `finish_reason` is set on its last output.

    `cached_tokens` is set on a request's first token only: how many prompt tokens the radix cache
    supplied at admission (whole pages; `usage.prompt_tokens_details.cached_tokens` downstream).
    `prompt_logprobs` too, for a request that asked: the log-prob of each prompt token after the first
    (the first has none), and `prompt_top_logprobs` the top alternatives at each of those positions.
    """

    rid: int
    token_id: int | None  # None for an output that only carries a finish (abort)
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    cached_tokens: int | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
