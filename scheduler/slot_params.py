"""Per-slot copies of each running request's sampling parameters, as numpy columns.

A request's parameters never change while it runs, so they are written once, when it takes a slot,
and every batch gathers its rows' values with one numpy index per column: a decode batch of 256 rows
would otherwise walk its requests a dozen times in Python each step.
"""

from __future__ import annotations

import numpy as np

from tandem.scheduler.messages import SamplingSpec

# The rows of `SlotParams.floats` and `SlotParams.ints`, in order: a batch gathers each table once.
FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
INT_PARAMS = ("top_k", "seed", "prompt_len")


class SlotParams:
    """Columns indexed by request slot; a slot's values are meaningful only while it is taken.

    The parameters the sampler reads on the device are rows of two tables (`floats`, `ints`; the named
    columns are views of their rows), so a batch gathers and stages two arrays, not nine."""

    def __init__(self, max_running: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        n = max_running
        self.eos_token_ids = eos_token_ids
        self.floats = np.zeros((len(FLOAT_PARAMS), n), dtype=np.float32)
        self.ints = np.zeros((len(INT_PARAMS), n), dtype=np.int64)
        # Views of the tables' rows, in FLOAT_PARAMS' and INT_PARAMS' order.
        (
            self.temperature,
            self.top_p,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
        ) = self.floats
        self.top_k, self.seed, self.prompt_len = self.ints
        self.top_p.fill(1.0)
        self.repetition_penalty.fill(1.0)
        self.explicit_seed = np.zeros(n, dtype=bool)
        self.has_penalty = np.zeros(n, dtype=bool)
        self.logprobs = np.full(n, -1, dtype=np.int64)  # -1: none requested
        self.prompt_logprobs = np.full(n, -1, dtype=np.int64)  # top alternatives per prompt token; -1: none
        # Additive logit constraints (engine/constraints.py): logit_bias always, and -inf on the tokens
        # that would end the output while fewer than min_tokens outputs are scheduled.
        self.has_bias = np.zeros(n, dtype=bool)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.bias: list[tuple[list[int], list[float]]] = [([], [])] * n
        self.end_ids: list[list[int]] = [[]] * n

    def set(self, slot: int, spec: SamplingSpec, seed: int, prompt_len: int) -> None:
        self.temperature[slot] = spec.temperature
        self.top_p[slot] = spec.top_p
        self.top_k[slot] = spec.top_k
        self.min_p[slot] = spec.min_p
        self.seed[slot] = seed
        self.explicit_seed[slot] = spec.seed is not None
        self.presence_penalty[slot] = spec.presence_penalty
        self.frequency_penalty[slot] = spec.frequency_penalty
        self.repetition_penalty[slot] = spec.repetition_penalty
        self.has_penalty[slot] = (
            spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0 or spec.repetition_penalty != 1.0
        )
        self.prompt_len[slot] = prompt_len
        self.logprobs[slot] = -1 if spec.logprobs is None else spec.logprobs
        self.prompt_logprobs[slot] = -1 if spec.prompt_logprobs is None else spec.prompt_logprobs
        self.has_bias[slot] = bool(spec.logit_bias)
        self.bias[slot] = ([t for t, _ in spec.logit_bias], [b for _, b in spec.logit_bias])
        # Under a grammar the grammar decides where the output ends (it may allow nothing but the end
        # token), so min_tokens only holds back the ends of unconstrained outputs.
        self.min_tokens[slot] = 0 if spec.grammar is not None else spec.min_tokens
        ends = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(self.eos_token_ids))
        self.end_ids[slot] = sorted(ends)
