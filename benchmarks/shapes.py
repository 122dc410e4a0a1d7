"""Benchmark models: real architectures' shapes with random bf16 weights, and what one step must cost.

Weights are drawn on the GPU (seconds even for 8B parameters) and written as one bf16 safetensors file
next to the tiny tokenizer, in the HF layout `tandem.LLM` loads. Values are random: throughput and
latency do not depend on them (with `ignore_eos`), but they are never all zeros.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tandem.engine.config import ModelConfig
from tandem.engine.tiny import load_tiny_tokenizer, tiny_config
from tandem.engine.tiny.tokenizer import VOCAB_SIZE

QWEN3_0_6B: dict[str, Any] = {
    "num_hidden_layers": 28,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
LLAMA_3_1_8B: dict[str, Any] = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
}
GEMMA_3_1B: dict[str, Any] = {  # 5 sliding-window layers (window 512) per global layer
    "num_hidden_layers": 26,
    "hidden_size": 1152,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "intermediate_size": 6912,
    "vocab_size": 262144,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}
SHAPES = {
    "qwen3-0.6b": ("qwen3", QWEN3_0_6B),
    "llama-3.1-8b": ("llama", LLAMA_3_1_8B),
    "gemma-3-1b": ("gemma3", GEMMA_3_1B),
}


def write_random_model(
    path: Path,
    family: str,
    *,
    device: torch.device,
    seed: int = 0,
    covering_tokenizer: bool = False,
    **overrides: Any,
) -> Path:
    """An HF model directory with random bf16 weights; reused when `path` already holds the same spec.

    The tokenizer is the tiny one (512 ids, under any head), or with `covering_tokenizer` the tiny one
    widened to the head's vocabulary, so every id has text as in a real model: what structured outputs'
    masks and the detokenizer cost depends on the vocabulary, not on the head alone."""
    spec = {"family": family, "seed": seed, "overrides": overrides, "version": 1}
    if covering_tokenizer:
        spec["tokenizer"] = "covering"
    marker = path / "tandem-random-model.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **overrides)
    with torch.device("meta"):  # names and shapes only; no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(path)
    load_tiny_tokenizer(config.vocab_size if covering_tokenizer else VOCAB_SIZE).save_pretrained(path)
    gen = torch.Generator(device=device).manual_seed(seed)
    gemma = family.startswith("gemma")
    tensors: dict[str, torch.Tensor] = {}
    for name, param in skeleton.named_parameters():
        if param.ndim == 1:  # norms (Gemma stores w - 1) and biases
            value = torch.zeros(param.shape, device=device) if gemma or name.endswith("bias") else None
            value = torch.ones(param.shape, device=device) if value is None else value
        else:
            std = 0.02 if "embed" in name or "lm_head" in name else param.shape[-1] ** -0.5
            value = torch.randn(param.shape, generator=gen, device=device) * std
        tensors[name] = value.to(torch.bfloat16).cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(json.dumps(spec))
    return path


def write_dummy_model(
    path: Path, family: str, shape: dict[str, Any], *, quantization: dict[str, Any] | None = None
) -> Path:
    """config.json and the tiny tokenizer, and no weights: the engine draws them (`load_format="dummy"`),
    in the format `quantization` (a checkpoint's `quantization_config`) names: FP8 blocks, MXFP4 experts."""
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **shape)
    with torch.device("meta"):  # the architecture's class name; no memory
        config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
    config.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config", None)
    if quantization is not None:
        raw["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    load_tiny_tokenizer().save_pretrained(path)
    return path


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of one forward step, from the architecture alone (bf16 weights and KV)."""

    weight_bytes: int  # read once per step: every layer's matrices and the LM head
    linear_flops_per_token: int  # 2 x matrix parameters of the layers
    lm_head_flops_per_row: int  # per sampled row
    kv_bytes_per_token_layer: int  # K and V of one token in one layer
    attn_flops_per_pair_layer: int  # QK^T and PV for one (query, key) pair in one layer
    full_layers: int
    window_layers: int
    window: int | None

    @classmethod
    def of(cls, config: ModelConfig, elem: int = 2) -> ModelCost:
        c = config
        per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        per_layer += c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        lm_head = c.vocab_size * c.hidden_size
        windowed = sum(1 for i in range(c.num_layers) if c.window_of(i) is not None)
        return cls(
            weight_bytes=(c.num_layers * per_layer + lm_head) * elem,
            linear_flops_per_token=2 * c.num_layers * per_layer,
            lm_head_flops_per_row=2 * lm_head,
            kv_bytes_per_token_layer=2 * c.num_kv_heads * c.head_dim * elem,
            attn_flops_per_pair_layer=4 * c.num_heads * c.head_dim,
            full_layers=c.num_layers - windowed,
            window_layers=windowed,
            window=c.sliding_window,
        )

    def kv_read_bytes(self, context: int, *, page_size: int = 16, evict: bool = True) -> int:
        """KV bytes one decode row reads at `context` tokens. Window layers read from the evicted
        boundary: the window plus up to one page of slack; without eviction, everything."""
        local = context
        if self.window is not None and evict:
            local = min(context, self.window + page_size)
        return self.kv_bytes_per_token_layer * (self.full_layers * context + self.window_layers * local)

    def prefill_flops(self, prompt: int) -> int:
        """Linear layers for every prompt token, causal attention, and the LM head for the last one."""
        pairs_full = prompt * (prompt + 1) // 2
        w = self.window or prompt
        pairs_local = sum(min(i + 1, w) for i in range(prompt)) if self.window_layers else 0
        attn = self.attn_flops_per_pair_layer * (
            self.full_layers * pairs_full + self.window_layers * pairs_local
        )
        return self.linear_flops_per_token * prompt + attn + self.lm_head_flops_per_row

    def decode_step_floor(
        self, contexts: list[int], bandwidth: float, flops: float, *, evict: bool = True
    ) -> float:
        """Seconds: one decode step over rows at these contexts can go no faster than its bytes at
        `bandwidth` or its FLOPs at `flops`, whichever is slower."""
        read = self.weight_bytes + sum(self.kv_read_bytes(c, evict=evict) for c in contexts)
        work = len(contexts) * (self.linear_flops_per_token + self.lm_head_flops_per_row)
        work += sum(
            self.attn_flops_per_pair_layer * (self.full_layers + self.window_layers) * c for c in contexts
        )
        return max(read / bandwidth, work / flops)
