"""HF `architectures` names -> model classes, imported on first use."""

from __future__ import annotations

import importlib

from tandem.engine.models.common import CausalLM

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module = importlib.import_module(f"tandem.engine.models.{_MODELS[architecture]}")
    cls: type[CausalLM] = getattr(module, architecture)
    return cls
