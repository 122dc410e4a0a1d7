"""One rank's options: the scheduler's own, declared here once, and the engine's (`EngineOptions`).

Torch-free, so the serve config (deploy/config/args.py) can generate its schema from these classes cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.engine.options import EngineOptions, check_fields, from_vllm, option
from tandem.scheduler.spec.config import SpeculativeConfig


@dataclass(frozen=True)
class RuntimeOptions:
    """The LLM options of ARCHITECTURE §6 plus the engine's; None means "pick for the device"."""

    chunk_size: int | None = option(
        None,
        "Chunked-prefill token budget per step; unset picks the engine's default.",
        ge=1,
        vllm="max_num_batched_tokens",
    )
    prefix_cache: bool = option(
        True, "Reuse KV pages across requests through the radix cache.", vllm="enable_prefix_caching"
    )
    overlap: bool = option(
        True, "Run the overlap scheduler (build batch N+1 while batch N runs); False for ablation."
    )
    max_running: int | None = option(
        None,
        "Most requests in one running batch; unset derives it from the device.",
        ge=1,
        vllm="max_num_seqs",
    )
    seed: int = option(0, "Seed of the sampler's generator, identical on every TP rank.", ge=0, vllm="seed")
    max_model_len: int | None = option(
        None,
        "Longest prompt plus output in tokens; unset uses the model's own limit.",
        ge=1,
        vllm="max_model_len",
    )
    max_cpu_loras: int | None = option(
        None,
        "LoRA adapters each rank keeps read in host memory (beyond those in GPU slots, which are reloaded "
        "from it); unset: twice max_loras.",
        ge=1,
        vllm="max_cpu_loras",
    )
    # `option` returns a dataclasses.field (RUF009 cannot see it for a non-builtin annotation).
    speculative_config: SpeculativeConfig | None = option(  # noqa: RUF009
        None,
        "Speculative decoding, as vLLM's speculative_config: method, num_speculative_tokens, model, "
        "prompt_lookup_min, prompt_lookup_max (docs/serve-config.md#speculative-decoding); unset: off.",
    )
    guard_inflight_pages: bool = option(
        False, "Check that no page in use by a running step is handed out again (debugging).", user=False
    )
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        # The user's dict (LLM keyword, serve config) becomes the dataclass; a bad one names its field.
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        check_fields(self)

    @property
    def device(self) -> str:
        """The engine's device option ('auto', 'cpu', 'cuda'...), which placement reads too."""
        return self.engine.device

    def validate(self) -> None:
        """Construction validates already; kept for callers that build options in steps."""
        check_fields(self)
        check_fields(self.engine)

    @classmethod
    def of(cls, **kwargs: Any) -> RuntimeOptions:
        """From one flat set of keywords (the `LLM` constructor's, a serve config's `engine:` block):
        the scheduler's own fields here, the rest into `EngineOptions`; vLLM's names of them are taken
        too (`max_num_seqs`, ...); an unknown name is a TypeError."""
        kwargs = from_vllm(kwargs, cls, EngineOptions)
        own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        engine = {f.name for f in dataclasses.fields(EngineOptions)}
        unknown = sorted(set(kwargs) - own - engine)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(
            engine=EngineOptions(**{k: v for k, v in kwargs.items() if k in engine}),
            **{k: v for k, v in kwargs.items() if k in own},
        )

    def flat(self) -> dict[str, Any]:
        """The inverse of `of`: every option by name."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"}
        out.update(dataclasses.asdict(self.engine))
        return out
