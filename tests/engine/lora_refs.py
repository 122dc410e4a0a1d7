"""Adapters and references for the LoRA tests: random adapters saved by PEFT itself (B drawn, not PEFT's
zeros) or by `write_random_adapter`, and HF's greedy tokens with an adapter merged by PEFT."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM


def peft_adapter(model_dir: Path, out: Path, *, seed: int, b_std: float = 0.5, **lora: Any) -> Path:
    """A PEFT `LoraConfig(**lora)` adapter on the model, A and B drawn from a private generator, saved by
    `save_pretrained`."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * (b_std / math.sqrt(param.shape[1])))
    model.save_pretrained(out)
    return out


def merged_greedy(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    """HF's greedy tokens for each prompt, with `adapter` merged into the weights by PEFT (None: base)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)
            outs.append(ids[0, len(p) :].tolist())
    return outs
