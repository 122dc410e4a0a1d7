"""FP8 checkpoints as the hub stores them, read as dequantized slices so TP shards and merged layers
need nothing special: each read takes the scales of exactly the rows and columns it returns.

Two formats (config.json's `quantization_config`):
- transformers' `quant_method: "fp8"`: float8_e4m3fn weights with `weight_scale_inv` per block of
  `weight_block_size` (usually 128 x 128), dynamic activations. Despite the name the scale multiplies:
  w = w_fp8 * weight_scale_inv (as transformers' FP8Linear and DeepSeek's checkpoints have it).
- compressed-tensors `format: "float-quantized"`: `weight_scale` per output channel ([N, 1]) or per
  tensor ([1] or a scalar), dynamic per-token activations, an `ignore` list (usually `lm_head`) of
  modules kept in bf16.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.engine.layers.source import TensorSource

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Checkpoint entries a weight's loader reads with the weight, never on their own.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")
KV_SCALE_SUFFIXES = ("k_scale", "v_scale")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint's FP8 weights are scaled."""

    method: str  # "fp8" (transformers, block-scaled) or "compressed-tensors"
    scale_suffix: str  # the weight's scale entry: "weight_scale_inv" or "weight_scale"
    block: tuple[int, int] | None  # (rows, columns) per scale; None: per channel or per tensor
    ignore: tuple[str, ...] = ()  # modules kept in the compute dtype (their tensors carry no scale)

    @classmethod
    def from_config(cls, raw: dict[str, Any] | None) -> Fp8Checkpoint | None:
        """None for an unquantized checkpoint; ValueError for a quantization tandem does not load."""
        if not raw:
            return None
        method = raw.get("quant_method")
        if method == "mxfp4":
            return None  # not FP8: quant/mxfp4.py reads it
        if method == "fp8":
            if raw.get("activation_scheme", "dynamic") != "dynamic":
                raise ValueError("FP8 checkpoints with static activation scales are not supported")
            block = raw.get("weight_block_size")
            return cls(
                method="fp8",
                scale_suffix="weight_scale_inv",
                block=(int(block[0]), int(block[1])) if block else None,
                ignore=tuple(raw.get("modules_to_not_convert") or ()),
            )
        if method == "compressed-tensors":
            if raw.get("format") != "float-quantized":
                raise ValueError(
                    f"compressed-tensors format {raw.get('format')!r} is not supported; "
                    "tandem loads 'float-quantized' (FP8) checkpoints"
                )
            for name, group in (raw.get("config_groups") or {}).items():
                weights = group.get("weights") or {}
                if weights.get("type") != "float" or weights.get("num_bits") != 8:
                    raise ValueError(f"compressed-tensors group {name!r} is not FP8 weights")
                if weights.get("strategy") not in ("channel", "tensor"):
                    raise ValueError(
                        f"compressed-tensors group {name!r}: strategy {weights.get('strategy')!r}"
                    )
                acts = group.get("input_activations")
                if acts and not acts.get("dynamic", False):
                    raise ValueError("FP8 checkpoints with static activation scales are not supported")
            return cls(
                method="compressed-tensors",
                scale_suffix="weight_scale",
                block=None,
                ignore=tuple(raw.get("ignore") or ()),
            )
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; tandem loads 'fp8', "
            "'compressed-tensors' (FP8) and 'mxfp4' (gpt-oss's experts) checkpoints"
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> Fp8Checkpoint | None:
        path = model_dir / "config.json"
        if not path.is_file():
            return None
        with path.open() as f:
            raw = json.load(f)
        text = raw.get("text_config")
        quant = raw.get("quantization_config") or (text or {}).get("quantization_config")
        return cls.from_config(quant)

    def expert_block(self, device: torch.device, *, triton: bool) -> tuple[int, int] | None:
        """The block in which MoE experts stay FP8 in memory: on CUDA with the Triton MoE kernels, which
        read FP8 weights and scale each block themselves (moe/triton_fp8.py), for block-scaled
        checkpoints of a block they take (its columns a power of two of at least 16), on GPUs whose
        Triton converts FP8 in registers (compute capability 8.9 on). None: the experts are dequantized
        at load (CPU: the torch path computes on exactly HF's values), as they are where the checkpoint
        keeps some experts 16-bit (its `ignore` list names experts)."""
        if self.block is None or device.type != "cuda" or not triton or not fp8_block_fits(self.block):
            return None
        if any("experts" in module for module in self.ignore):
            return None
        return self.block if torch.cuda.get_device_capability(device) >= (8, 9) else None

    def scale_name(self, weight_name: str) -> str:
        return weight_name.removesuffix("weight") + self.scale_suffix


def fp8_block_fits(block: tuple[int, int]) -> bool:
    """Whether the MoE kernels read FP8 weights of this scale block: its columns a power of two of at
    least 16 (a GEMM's K step, a power of two of at least 16, must lie within one block), rows any."""
    rows, cols = block
    return rows > 0 and cols >= 16 and cols & (cols - 1) == 0


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES) or name.endswith(KV_SCALE_SUFFIXES)


class DequantSource:
    """An FP8 weight read as float32 slices, w_fp8 * scale, with the scale of each element it returns."""

    def __init__(self, weight: TensorSource, scale: TensorSource, block: tuple[int, int] | None) -> None:
        self.name = weight.name
        self._weight = weight
        self._scale = scale
        self._block = block

    @property
    def shape(self) -> tuple[int, ...]:
        return self._weight.shape

    @property
    def block(self) -> tuple[int, int] | None:
        return self._block

    def read(self, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
        w = self._weight.read(dim, start, size).float()
        return w * self._scales(dim, start, w.shape[dim])

    def read_fp8(self, dim: int, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A block-scaled weight's slice as stored, not dequantized: the float8_e4m3fn [rows, cols] along
        `dim` and the float32 scales of the blocks that cover it. `start` must begin a block (the
        caller checks a TP split keeps whole blocks: MoEExperts.check_fp8_split)."""
        if self._block is None or start % self._block[dim]:
            raise ValueError(f"FP8 tensor {self.name!r}: a slice from {start} along dim {dim} does not "
                             f"begin a scale block {self._block}")  # fmt: skip
        step = self._block[dim]
        first, end = start // step, -(-(start + size) // step)
        weight = self._weight.read(dim, start, size)
        if weight.dtype != FP8:
            raise ValueError(f"FP8 tensor {self.name!r} is {weight.dtype}, not float8_e4m3fn")
        return weight, self._scale.read(dim, first, end - first).float()

    def _scales(self, dim: int, start: int, size: int) -> torch.Tensor:
        """The scale of every element of the [rows, cols] slice along `dim`, broadcastable to it."""
        rows, cols = self.shape
        if self._block is None:
            scale = self._scale.read().float()
            if scale.numel() == 1:  # per tensor
                return scale.reshape(1, 1)
            scale = scale.reshape(rows, 1)  # per output channel
            return scale[start : start + size] if dim == 0 else scale
        full = self._scale.read().float()  # [ceil(rows / b0), ceil(cols / b1)]: small
        b0, b1 = self._block
        expanded = full.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
        return expanded.narrow(dim, start, size)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], float32 [N]) with w ~ w_fp8 * scale, one scale per output row
    (its largest magnitude maps to FP8's 448)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], float32 [ceil(N / b0), ceil(K / b1)]): one scale per `block`
    (edge blocks cover what is left), on the weight's device."""
    w = weight.float()
    rows, cols = w.shape
    b0, b1 = block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(nr * b0, nc * b1, device=w.device)
    padded[:rows, :cols] = w
    amax = padded.view(nr, b0, nc, b1).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    expanded = scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale.reshape(-1, 1)


_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_kv_scales(entries: dict[str, float]) -> dict[int, tuple[float, float]]:
    """Checkpoint KV-cache scales ("model.layers.3.self_attn.k_scale" or "...k_proj.k_scale") -> layer ->
    (k scale, v scale); a layer with one of the two keeps 1.0 for the other."""
    found: dict[int, dict[str, float]] = {}
    for name, value in entries.items():
        match = _LAYER.search(name)
        if match is not None:
            found.setdefault(int(match.group(1)), {})[name.rsplit(".", 1)[-1]] = value
    return {layer: (s.get("k_scale", 1.0), s.get("v_scale", 1.0)) for layer, s in found.items()}
