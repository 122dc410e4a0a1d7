"""Random LoRA adapters in PEFT's on-disk format, for tests and benchmarks: `adapter_config.json` and
`adapter_model.safetensors` with PEFT's tensor names, so PEFT itself loads them too.

Unlike a fresh PEFT adapter (whose B is zero, a no-op), both A and B are drawn, at a scale that changes
a tiny model's greedy output while keeping its logits decisive."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.engine.config import ModelConfig
from tandem.engine.lora.peft_format import PROJECTIONS, projection_shape

ALL_PROJECTIONS = tuple(PROJECTIONS)


def write_random_adapter(
    path: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Iterable[str] = ALL_PROJECTIONS,
    seed: int = 0,
    b_std: float = 0.5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **config: Any,
) -> Path:
    """Write a rank-`rank` adapter of the model at `model_dir` on `targets` into `path` and return it.
    A ~ N(0, 1/in), B ~ N(0, (b_std^2)/rank); `config` adds adapter_config.json fields."""
    model = ModelConfig.from_dir(model_dir)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    names = list(targets)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model.num_layers):
        for proj in names:
            out_features, in_features = projection_shape(model, proj)
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            a = torch.randn(rank, in_features, generator=gen, device=device) / math.sqrt(in_features)
            b = torch.randn(out_features, rank, generator=gen, device=device) * (b_std / math.sqrt(rank))
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).cpu().contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).cpu().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    fields = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": names,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        **config,
    }
    (out / "adapter_config.json").write_text(json.dumps(fields, indent=2))
    return out
