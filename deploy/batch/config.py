"""`ProcessorConfig`: what a batch job runs (the model, its engine options) and how wide (actors, rows).

Named as `ray.data.llm`'s engine processor configs name them, so a Ray Data user already knows them. The
engine options are checked here, in the driver, so a typo fails before any actor starts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.engine.options import EngineOptions, from_vllm
from tandem.scheduler.options import RuntimeOptions

# Set through the config's own fields, never through engine_kwargs (vLLM's tensor_parallel_size is
# moved to tp_size, as ray.data.llm's configs pass it there).
_OWN_FIELDS = {"device": "device", "tp_size": "tp_size"}


class ProcessorConfig(BaseModel):
    """One tandem engine per actor, `concurrency` actors, `batch_size` rows per Ray Data batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_source: str = Field(min_length=1, description="Hugging Face hub id or local model directory.")
    batch_size: int = Field(
        default=64,
        ge=1,
        description="Rows per batch handed to an actor. Smaller batches lose less work when an actor "
        "fails and spread better over actors; each actor runs several batches at once anyway.",
    )
    concurrency: int | tuple[int, int] = Field(
        default=1,
        description="Actors, each one engine: a fixed number, or (min, max) for an autoscaling pool.",
    )
    max_concurrent_batches: int = Field(
        default=8,
        ge=1,
        description="Batches one actor runs at once, so its engine always has rows queued: a batch "
        "that finishes is replaced while the others run. batch_size x this should exceed the engine's "
        "max_running.",
    )
    tp_size: int = Field(default=1, ge=1, description="Tensor-parallel degree: GPUs (rank actors) per actor.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device of the rank actors; 'auto' picks CUDA when the cluster has GPUs."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine options, as for the offline `LLM` constructor (max_running, chunk_size, ...), "
        "or under vLLM's names as ray.data.llm passes them (max_num_seqs, tensor_parallel_size, ...).",
    )
    chat_template: str | None = Field(
        default=None, min_length=1, description="A Jinja chat template file, or the template itself."
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="STRICT_PACK", description="Placement-group strategy for one actor's tp_size rank bundles."
    )
    cpus_per_rank: float = Field(
        default=1.0, gt=0.0, description="Logical CPUs reserved for each rank actor."
    )
    accelerator_type: str | None = Field(
        default=None, min_length=1, description="Ray accelerator type (e.g. 'H100') the GPU bundles need."
    )
    runtime_env: dict[str, Any] | None = Field(default=None, description="Ray runtime_env of the actors.")

    @model_validator(mode="before")
    @classmethod
    def _tensor_parallel_size(cls, data: Any) -> Any:
        engine = data.get("engine_kwargs") if isinstance(data, dict) else None
        if not isinstance(engine, dict) or "tensor_parallel_size" not in engine:
            return data
        engine = dict(engine)
        size = engine.pop("tensor_parallel_size")
        if data.get("tp_size", size) != size:
            raise ValueError(
                f"engine_kwargs.tensor_parallel_size={size!r} and tp_size={data['tp_size']!r} "
                "disagree: set one"
            )
        return {**data, "engine_kwargs": engine, "tp_size": size}

    @field_validator("concurrency")
    @classmethod
    def _check_concurrency(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (value, value) if isinstance(value, int) else value
        if not 1 <= low <= high:
            raise ValueError(
                f"concurrency must be an int >= 1 or (min, max) with 1 <= min <= max, got {value}"
            )
        return value

    @field_validator("engine_kwargs")
    @classmethod
    def _check_engine_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        misplaced = sorted(k for k in kwargs if k in _OWN_FIELDS)
        if misplaced:
            fields = ", ".join(f"{k} -> ProcessorConfig.{_OWN_FIELDS[k]}" for k in misplaced)
            raise ValueError(f"set these as ProcessorConfig fields, not engine_kwargs: {fields}")
        try:
            # vLLM's names (max_num_seqs, enable_prefix_caching, ...) become tandem's here.
            kwargs = from_vllm(kwargs, RuntimeOptions, EngineOptions)
            RuntimeOptions.of(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        return kwargs

    @property
    def pool_size(self) -> tuple[int, int]:
        """(min, max) actors."""
        return (self.concurrency, self.concurrency) if isinstance(self.concurrency, int) else self.concurrency
