"""The bodies of vLLM's run-time LoRA endpoints, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

_CONFIG = ConfigDict(extra="forbid")


class LoadLoraAdapterRequest(BaseModel):
    model_config = _CONFIG

    lora_name: str = Field(min_length=1, description="The name requests will give as `model`.")
    lora_path: str = Field(
        min_length=1,
        description="A PEFT adapter directory on the server (or a URI fsspec or smart_open reads).",
    )


class UnloadLoraAdapterRequest(BaseModel):
    model_config = _CONFIG

    lora_name: str = Field(min_length=1, description="The adapter to stop serving.")
    lora_int_id: int | None = Field(default=None, description="Accepted for vLLM's clients; unused.")
