"""The experts' gated activations (`MoESpec.activation`) in torch, for the torch path and the reference;
the Triton paths of fused.py run SiLU only (layer.py keeps other activations on the torch path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.moe.spec import MoESpec


def gated(gate: torch.Tensor, up: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """silu(gate) * up; or gpt-oss's clamped SwiGLU, in the order transformers computes it."""
    if spec.activation == "swiglu_clamped":
        limit = spec.swiglu_limit
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))
    return F.silu(gate) * up
