"""The arguments of the tandem Serve application: the `args:` block of a serve config.

`serve run` / `serve deploy` configs (`import_path: tandem.deploy.app:build_app`) and the Helm chart's
rendered `serveConfigV2` are both validated by `AppArgs`. Unknown keys are rejected, so a typo fails at
deploy time with the offending field named instead of being silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tandem.deploy.config.option_schema import options_model
from tandem.engine.options import EngineOptions
from tandem.scheduler.options import RuntimeOptions

TINY_MODEL_NAME = "tandem-tiny"
"""The served name of the demo model, used when `model` is left unset."""
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_CHOICES_PER_REQUEST = 512
DEFAULT_PROMPT_CHARS_PER_TOKEN = 32
DEFAULT_STUCK_RANK_TIMEOUT_S = 10.0


# The scheduler's and the engine's user options, generated from their dataclasses (engine/options.py).
_EngineFields = options_model("EngineArgs", RuntimeOptions, EngineOptions)


class EngineArgs(_EngineFields):  # type: ignore[misc,valid-type]  # a generated base
    """Options passed through to the offline `LLM` constructor for every replica."""

    def to_llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `LLM(model, **kwargs)`: the options the config set; the engine's
        defaults (the same as this model's) fill in the rest."""
        kwargs: dict[str, Any] = self.model_dump(exclude_unset=True)
        return kwargs


class AutoscalingArgs(BaseModel):
    """Serve autoscaling of replicas (each replica is one TP group of `tp_size` GPUs)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(
        default=1, ge=0, description="Fewest replicas; 0 lets the application scale to zero."
    )
    max_replicas: int = Field(default=1, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(
        default=None, ge=0, description="Replicas at deploy time; unset starts at min_replicas."
    )
    target_ongoing_requests: float | None = Field(
        default=None,
        gt=0.0,
        description="Ongoing requests per replica the autoscaler aims for; unset: the replica's "
        "max_ongoing_requests (its engine's capacity).",
    )
    upscale_delay_s: float | None = Field(
        default=None,
        ge=0.0,
        description="Seconds demand must stay high before adding replicas; unset: Serve's.",
    )
    downscale_delay_s: float | None = Field(
        default=None,
        ge=0.0,
        description="Seconds demand must stay low before removing replicas; unset: Serve's.",
    )
    metrics_interval_s: float | None = Field(
        default=None,
        gt=0.0,
        description="How often each replica reports its ongoing requests to the autoscaler; unset: Serve's.",
    )
    look_back_period_s: float | None = Field(
        default=None,
        gt=0.0,
        description="Window over which the autoscaler averages ongoing requests; unset: Serve's.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling_config.min_replicas ({self.min_replicas}) must be <= "
                f"autoscaling_config.max_replicas ({self.max_replicas})"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"autoscaling_config.initial_replicas ({self.initial_replicas}) must lie between "
                f"min_replicas ({self.min_replicas}) and max_replicas ({self.max_replicas})"
            )
        return self

    def to_serve_config(self) -> dict[str, Any]:
        """The dict for Serve's `autoscaling_config` deployment option (unset fields left to Serve)."""
        return self.model_dump(exclude_none=True)


class AppArgs(BaseModel):
    """Arguments of `tandem.deploy.app:build_app`: what to serve, how to shard it, and how to scale it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None,
        min_length=1,
        description="Hugging Face hub id or local model directory; unset serves the demo model on CPU.",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        description="Name clients put in the request's `model` field; defaults to `model` "
        f"(or '{TINY_MODEL_NAME}' for the demo model).",
    )
    tp_size: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel degree: GPUs (rank actors) per replica; vLLM's "
        "tensor_parallel_size is taken too, here or in the engine block.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device of the rank actors; 'auto' picks CUDA when present."
    )
    engine: EngineArgs = Field(
        default_factory=EngineArgs,
        description="Engine options, as for the offline `LLM` constructor, under tandem's names or vLLM's "
        "(max_num_seqs, enable_prefix_caching, ...); `engine_kwargs` is taken as its name too.",
    )
    num_replicas: int | None = Field(
        default=None,
        ge=1,
        description="Fixed number of replicas; unset means 1 unless autoscaling_config is given.",
    )
    autoscaling_config: AutoscalingArgs | None = Field(
        default=None, description="Autoscale replicas between bounds; exclusive with num_replicas."
    )
    prefix_routing: bool | None = Field(
        default=None,
        description="Route requests that share a prompt prefix to the replica that cached it; unset: on "
        "when num_replicas > 1 or autoscaling_config is set.",
    )
    max_ongoing_requests: int | None = Field(
        default=None,
        ge=1,
        description="Requests one replica runs at once; unset: what its engine runs at once (its max "
        "running requests, from the KV pool and cuda_graph_max_bs on GPU; 64 on CPU).",
    )
    max_queued_requests: int | None = Field(
        default=None,
        ge=-1,
        description="Requests one replica queues beyond those it runs before answering 503; -1 is "
        "unbounded; unset: four times max_ongoing_requests.",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="STRICT_PACK", description="Placement-group strategy for a replica's tp_size rank bundles."
    )
    cpus_per_rank: float = Field(
        default=1.0, gt=0.0, description="Logical CPUs reserved for each rank actor."
    )
    accelerator_type: str | None = Field(
        default=None,
        min_length=1,
        description="Ray accelerator type (e.g. 'H100') the GPU bundles must land on; unset: any GPU.",
    )

    # -- security and hardening (docs/serve-config.md#security) ------------------------------------
    api_key: SecretStr | list[SecretStr] | None = Field(
        default=None,
        description="API key(s) that /v1/* requests must send as `Authorization: Bearer <key>`; the "
        "TANDEM_API_KEY environment variable (comma separated) adds more. Neither set: no authentication. "
        "/health and /metrics stay open.",
    )
    max_request_body_bytes: int = Field(
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        ge=1024,
        description="Largest request body in bytes; a larger one gets 413 before it is parsed.",
    )
    max_choices_per_request: int = Field(
        default=DEFAULT_MAX_CHOICES_PER_REQUEST,
        ge=1,
        description="Most choices (prompts x n) one request may ask for; more gets 400.",
    )
    prompt_chars_per_token: int = Field(
        default=DEFAULT_PROMPT_CHARS_PER_TOKEN,
        ge=1,
        description="A prompt longer than max_model_len x this many characters gets 400 before it is "
        "tokenized (no real token is that long, so it cannot fit).",
    )
    chat_template: str | None = Field(
        default=None,
        min_length=1,
        description="A Jinja chat template file, or the template itself, replacing the tokenizer's. "
        "Clients can never choose the template.",
    )
    allowed_origins: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Origins a browser may call the API from (CORS), as vLLM's --allowed-origins: ['*'] "
        "(the default, as vLLM's) is any; [] sends no CORS headers. Preflights (OPTIONS) are answered "
        "before the API key is checked; the request that follows still needs it.",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default=None,
        description="The format of the model's tool calls under tool_choice 'auto' (vLLM's "
        "--tool-call-parser); unset tries each format tandem parses.",
    )
    enable_auto_tool_choice: bool = Field(
        default=True,
        description="Parse the model's own tool calls under tool_choice 'auto' (vLLM's "
        "--enable-auto-tool-choice; on unless set false, when 'auto' with tools gets 400).",
    )
    # -- LoRA adapters (docs/serve-config.md#lora-adapters) -----------------------------------------
    lora_modules: dict[str, str] | None = Field(
        default=None,
        description="LoRA adapters served by name: {name: path}, or vLLM's list of 'name=path' entries "
        "(or JSON objects with name and path); each path a PEFT adapter directory or a URI fsspec or "
        "smart_open reads. A request names one as its `model` (or `<served_model_name>:<name>`). Turns "
        "engine.enable_lora on.",
    )
    lora_dynamic_path: str | None = Field(
        default=None,
        min_length=1,
        description="A folder of adapters (local, or a URI fsspec or smart_open reads): a request for "
        "`<served_model_name>:<name>` serves `<folder>/<name>`, loaded on first use (Ray Serve LLM's "
        "dynamic LoRA loading). Turns engine.enable_lora on.",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3", "openai_gptoss"] | None = Field(
        default=None,
        description="Split a reasoning model's <think>...</think> out of chat replies into "
        "`reasoning_content` (as vLLM's --reasoning-parser); tool calls and structured outputs then apply "
        "to what follows the reasoning. `openai_gptoss` (vLLM's name for gpt-oss) serves chats in the "
        "harmony format, which gpt-oss models get without it; another parser for a gpt-oss model fails "
        "at start.",
    )
    stuck_rank_timeout_s: float = Field(
        default=DEFAULT_STUCK_RANK_TIMEOUT_S,
        gt=0.0,
        description="A rank that has work but has not finished a step for this long fails the replica's "
        "health, and its requests end with an error.",
    )

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: Any) -> Any:
        """vLLM's and Ray Serve LLM's spellings: `engine_kwargs` for `engine`, and
        `tensor_parallel_size` (there or at the top) for `tp_size`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "engine_kwargs" in data:
            if "engine" in data:
                raise ValueError("engine and engine_kwargs are both set: set one")
            data["engine"] = data.pop("engine_kwargs")
        engine = data.get("engine")
        if isinstance(engine, dict) and "tensor_parallel_size" in engine:
            engine = dict(engine)
            data["engine"] = engine
            _move(engine, "tensor_parallel_size", data, "tp_size")
        if "tensor_parallel_size" in data:
            _move(data, "tensor_parallel_size", data, "tp_size")
        return data

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return value
        modules: dict[str, str] = {}
        for entry in value:
            name, path = _lora_module(entry)
            if name in modules:
                raise ValueError(f"lora_modules names {name!r} twice")
            modules[name] = path
        return modules

    @model_validator(mode="after")
    def _check_lora(self) -> AppArgs:
        wanted = bool(self.lora_modules) or self.lora_dynamic_path is not None
        if wanted and "enable_lora" in self.engine.model_fields_set and not self.engine.enable_lora:
            raise ValueError("lora_modules and lora_dynamic_path need engine.enable_lora, which is false")
        for name in self.lora_modules or {}:
            if not name or ":" in name or name == self.resolved_served_model_name():
                raise ValueError(f"lora_modules: {name!r} cannot name an adapter (no ':', not the base name)")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's options for every replica (`EngineArgs.to_llm_kwargs`), LoRA on when adapters are
        configured."""
        kwargs = self.engine.to_llm_kwargs()
        if self.lora_modules or self.lora_dynamic_path is not None:
            kwargs["enable_lora"] = True
        return kwargs

    @model_validator(mode="after")
    def _check_replicas(self) -> AppArgs:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError(
                "set either num_replicas or autoscaling_config, not both "
                f"(got num_replicas={self.num_replicas} and an autoscaling_config)"
            )
        return self

    def api_keys(self) -> list[str]:
        """The configured API keys in clear (TANDEM_API_KEY is added where the app is built)."""
        if self.api_key is None:
            return []
        keys = self.api_key if isinstance(self.api_key, list) else [self.api_key]
        return [key.get_secret_value() for key in keys]

    def resolved_served_model_name(self) -> str:
        """The model name clients address: `served_model_name`, else `model`, else the tiny model's."""
        if self.served_model_name is not None:
            return self.served_model_name
        if self.model is not None:
            return self.model
        return TINY_MODEL_NAME

    def rank_bundle(self, *, use_gpu: bool) -> dict[str, float]:
        """Resources of one rank's placement-group bundle (bundle 0 also takes the replica's own CPU).

        An `accelerator_type` adds a sliver of Ray's `accelerator_type:<T>` resource, which Ray
        advertises on nodes whose GPUs are of that type, so the bundle only fits there.
        """
        bundle: dict[str, float] = {"CPU": self.cpus_per_rank}
        if use_gpu:
            bundle["GPU"] = 1.0
            if self.accelerator_type is not None:
                bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


def _move(source: dict[str, Any], key: str, target: dict[str, Any], name: str) -> None:
    """`source[key]` to `target[name]`; a ValueError when `target` holds another value there already."""
    value = source.pop(key)
    if name in target and target[name] != value:
        raise ValueError(f"{key}={value!r} and {name}={target[name]!r} disagree: set one")
    target[name] = value


def _lora_module(entry: Any) -> tuple[str, str]:
    """(name, path) of one `lora_modules` entry: 'name=path', or a JSON object with name and path."""
    raw: Any
    if isinstance(entry, dict):
        raw = entry
    elif isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            raw = json.loads(entry)
        except ValueError as exc:
            raise ValueError(f"lora_modules entry {entry!r} is not valid JSON: {exc}") from None
    elif isinstance(entry, str) and "=" in entry:
        name, path = entry.split("=", 1)
        raw = {"name": name, "path": path}
    else:
        raise ValueError(f"lora_modules entry {entry!r} must be 'name=path' or {{'name', 'path'}}")
    name, path = raw.get("name"), raw.get("path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"lora_modules entry {entry!r} needs a non-empty name and path")
    return name, path
