"""MXFP4 checkpoints (`quantization_config.quant_method == "mxfp4"`: gpt-oss on the hub), dequantized at
load. Only the MoE experts' projections are stored so: `*.experts.gate_up_proj_blocks` [E, 2I, H / 32, 16]
and `*_scales` [E, 2I, H / 32], the same for `down_proj` ([E, H, I / 32, 16]). Each byte holds two e2m1
values, the low nibble first; each block of 32 values shares one e8m0 scale, 2^(scale - 127).

`Mxfp4Source` presents a blocks/scales pair as the dense tensor transformers' `convert_moe_packed_tensors`
makes of it (the packed axis last, then transposed to [E, H, 2I] / [E, I, H], the layout of its
`GptOssExperts`), so the experts load it as they load the bf16 layout; a read along the experts' axis
dequantizes only the experts it returns, so each rank dequantizes only its shard.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.engine.layers.source import TensorSource

MXFP4 = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # values per scale
# e2m1: sign, two exponent bits, one mantissa bit, by code.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1) / len(E2M1))  # of a uniformly random code


@dataclass(frozen=True)
class Mxfp4Checkpoint:
    """An MXFP4 checkpoint's naming: which entries are blocks, which scales, and what they dequantize to."""

    @classmethod
    def from_config(cls, raw: dict[str, Any] | None) -> Mxfp4Checkpoint | None:
        return cls() if raw and raw.get("quant_method") == MXFP4 else None

    @classmethod
    def from_dir(cls, model_dir: Path) -> Mxfp4Checkpoint | None:
        path = model_dir / "config.json"
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls.from_config(raw.get("quantization_config"))

    @staticmethod
    def resident(device: torch.device, *, triton: bool) -> bool:
        """Whether the experts stay 4-bit in memory: on CUDA with the Triton MoE kernels, which unpack
        them as they read (moe/triton_mxfp4.py); elsewhere they are dequantized at load."""
        return device.type == "cuda" and triton

    @staticmethod
    def weight_name(name: str) -> str:
        """The dense tensor's name of a blocks entry (any other name is its own)."""
        return name.removesuffix(BLOCKS)

    @staticmethod
    def is_scales(name: str) -> bool:
        return name.endswith(SCALES)

    @staticmethod
    def is_blocks(name: str) -> bool:
        return name.endswith(BLOCKS)

    @staticmethod
    def source(blocks: TensorSource, sources: dict[str, Any]) -> Mxfp4Source:
        scales_name = blocks.name.removesuffix(BLOCKS) + SCALES
        scales = sources.get(scales_name)
        if scales is None:
            raise ValueError(f"MXFP4 tensor {blocks.name!r} has no {scales_name!r} in the checkpoint")
        return Mxfp4Source(blocks, scales)


def fill_dummy(param: torch.Tensor, *, scales: bool, generator: torch.Generator) -> None:
    """`load_format="dummy"` for resident MXFP4 experts: blocks of random bytes (every code, both
    signs), and one scale for all that brings them near N(0, 1 / fan_in), as the dense draw is: the
    power of two nearest fan_in^-1/2 over the codes' RMS (fan_in: the row's values, 32 a scale)."""
    if not scales:
        param.random_(0, 256, generator=generator)
        return
    fan_in = param.shape[-1] * BLOCK
    param.fill_(127 + round(math.log2(fan_in**-0.5 / E2M1_RMS)))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and e8m0 scales [..., G] -> float32 [..., G * 32] (exact: every value is
    an e2m1 value times a power of two)."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    packed = blocks.to(torch.uint8).to(torch.int64)
    values = torch.stack((table[packed & 0x0F], table[packed >> 4]), dim=-1)  # low nibble first
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values.flatten(-2), exponent.unsqueeze(-1).float())
    return values.flatten(-2)


class Mxfp4Source:
    """A blocks/scales pair read as the dense [E, packed * 32, rows] tensor transformers makes of it."""

    def __init__(self, blocks: TensorSource, scales: TensorSource) -> None:
        self.name = blocks.name
        self._blocks, self._scales = blocks, scales
        experts, rows, groups, half = blocks.shape
        if half != BLOCK // 2 or tuple(scales.shape) != (experts, rows, groups):
            raise ValueError(
                f"MXFP4 tensor {blocks.name!r} has shape {list(blocks.shape)} and its scales "
                f"{list(scales.shape)}; expected [E, rows, G, 16] and [E, rows, G]"
            )
        self._shape = (experts, groups * BLOCK, rows)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def read_packed(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's bytes as stored, not dequantized: blocks [rows, G, 16] and scales [rows, G]."""
        return self._blocks.read(0, expert, 1)[0], self._scales.read(0, expert, 1)[0]

    def read(self, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
        if dim == 0:  # only these experts' blocks are read and dequantized
            dense = dequantize(self._blocks.read(0, start, size), self._scales.read(0, start, size))
            return dense.transpose(1, 2)
        dense = dequantize(self._blocks.read(), self._scales.read()).transpose(1, 2)
        end = self._shape[dim] if size is None else start + size
        return dense.narrow(dim, start, end - start)
