"""`load_format="dummy"`: a model's weights drawn at random on its device, from its `config.json` alone,
with no checkpoint read (vLLM's option of that name). For benchmarks of shapes whose checkpoint no host
disk holds (the 60 GB Qwen3-30B-A3B), and for tests that need a model without its weights.

The values make a well-scaled network rather than a trained one: matrices ~ N(0, 1/fan_in), embeddings and
the LM head ~ N(0, 0.02^2), norms at their neutral scale (1, or 0 where Gemma stores w - 1), biases (an
MoE's 2-D expert biases too) and attention sinks zero. An MXFP4 checkpoint's experts draw the layout the
engine holds them in: dense where they are dequantized at load (CPU), random bytes with scales of that
spread where they stay 4-bit (quant/mxfp4.py `fill_dummy`). Block-scaled FP8 experts that stay FP8 draw
N(0, 1) in FP8 with every block's scale fan_in^-1/2, the same spread again.
Each parameter draws from its own generator, seeded from its name, so every rank of a TP group draws the
same values for the parameters they all hold whole (norms, MoE routers): they route every token alike.
A split parameter's shards hold the same draw on every rank, which is as random as any other.
"""

from __future__ import annotations

import zlib

import torch

from tandem.engine.models.common import CausalLM
from tandem.engine.quant.fp8_format import FP8
from tandem.engine.quant.mxfp4 import fill_dummy
from tandem.engine.spec.head import DraftHead

EMBED_STD = 0.02


@torch.no_grad()
def init_dummy_weights(model: CausalLM | DraftHead, seed: int = 0) -> None:
    """Fill every parameter of `model` (a model, or a drafter's head) in place, on its device."""
    gemma = model.traits.gemma_norm
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if param.dtype == torch.uint8:  # resident MXFP4 experts: packed codes, or their e8m0 scales
            fill_dummy(param, scales=name.endswith("_scales"), generator=gen)
            continue
        if param.dtype == FP8:  # resident FP8 experts: N(0, 1), scaled by their blocks' scales below
            param.copy_(torch.randn(param.shape, generator=gen, device=param.device).to(FP8))
            continue
        if name.endswith(("w13_scales", "w2_scales")):  # their FP8 weight's fan-in
            param.fill_(model.get_parameter(name.removesuffix("_scales")).shape[-1] ** -0.5)
            continue
        if name.endswith(("bias", "b13", "b2", "sinks.weight")):
            param.zero_()
            continue
        if param.ndim == 1:
            neutral = 0.0 if name.endswith("bias") or gemma else 1.0
            param.fill_(neutral)
            continue
        std = EMBED_STD if "embed" in name or "lm_head" in name else param.shape[-1] ** -0.5
        param.normal_(0.0, std, generator=gen)
