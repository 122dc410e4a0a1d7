"""Write FP8 checkpoints in the hub's two formats from a 16/32-bit model directory, with the plain
checkpoint of the very weights they dequantize to beside it: tests build tiny ones at test time and
benchmarks the 8B shape's (a reference for HF transformers, and for top-1 agreement).

Quantized: every linear projection's weight (q/k/v/o, gate/up/down, DeepSeek's q_a/q_b/kv_a/kv_b) not
named in `ignore`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from tandem.engine.quant.fp8_format import FP8, FP8_MAX, quantize_blocks, quantize_per_channel
from tandem.engine.weights import safetensors_files

Fp8Layout = Literal["block", "channel", "tensor"]
# DeepSeek's latent attention: its low-rank query and latent projections too, as its FP8 releases have them.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
                "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # fmt: skip


def _quantize(
    weight: torch.Tensor, layout: Fp8Layout, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "block":
        return quantize_blocks(weight, block)
    if layout == "channel":
        wq, scale = quantize_per_channel(weight)
        return wq, scale.reshape(-1, 1)
    scale = (weight.float().abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantized(
    wq: torch.Tensor, scale: torch.Tensor, layout: Fp8Layout, block: tuple[int, int]
) -> torch.Tensor:
    """float32 weights, computed as the loader computes them (fp8_format.DequantSource)."""
    w = wq.float()
    if layout == "block":
        rows, cols = w.shape
        return w * scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w * (scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(-1, 1))


def _config(layout: Fp8Layout, block: tuple[int, int], ignore: list[str]) -> dict[str, object]:
    if layout == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
            "modules_to_not_convert": ignore,
        }
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": layout}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": acts}},
        "ignore": ["lm_head", *ignore],
    }


def write_fp8_checkpoint(
    src: Path,
    fp8_dir: Path,
    reference_dir: Path | None = None,
    *,
    layout: Fp8Layout,
    block: tuple[int, int] = (128, 128),
    ignore: tuple[str, ...] = (),
    reference_dtype: torch.dtype = torch.float32,
) -> None:
    """`fp8_dir`: `src` with its projections in FP8 (`layout`: transformers' block-scaled format, or
    compressed-tensors per channel or per tensor), modules in `ignore` (e.g. "model.layers.0.mlp.down_proj")
    left as they are. `reference_dir`: `src` with every weight replaced by what the FP8 one dequantizes to."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(src):
        tensors.update(load_file(str(path)))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    suffix = "weight_scale_inv" if layout == "block" else "weight_scale"
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in _PROJECTIONS and module not in ignore:
            wq, scale = _quantize(tensor, layout, block)
            quantized[name], quantized[f"{module}.{suffix}"] = wq, scale.float()
            if reference_dir is not None:
                reference[name] = dequantized(wq, scale, layout, block).to(reference_dtype)
        else:
            quantized[name] = tensor.contiguous()
            if reference_dir is not None:
                reference[name] = tensor.to(reference_dtype) if tensor.is_floating_point() else tensor
    config = json.loads((src / "config.json").read_text())
    for target, weights, quant in (
        (fp8_dir, quantized, _config(layout, block, list(ignore))),
        (reference_dir, reference, None),
    ):
        if target is None:
            continue
        target.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and not extra.name.endswith(".index.json"):
                shutil.copy2(extra, target / extra.name)
        save_file(weights, str(target / "model.safetensors"))
        out = dict(config)
        out.pop("quantization_config", None)
        if quant is not None:
            out["quantization_config"] = quant
        else:
            out["torch_dtype"] = str(reference_dtype).removeprefix("torch.")
        (target / "config.json").write_text(json.dumps(out, indent=2))
