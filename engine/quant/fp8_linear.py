"""FP8 linear layers: weights in float8_e4m3fn with one scale per output channel, GEMMs through
`torch._scaled_mm` with per-token activation scales computed on the fly (dynamic), on CUDA.

On CPU the weights stay in the compute dtype: FP8 checkpoints are read dequantized (fp8_format.py) and
`quantization="fp8"` rounds them through FP8 and back, so a CPU run is exactly the model whose weights are
the dequantized FP8 ones, the reference HF transformers runs in the tests. Activations are not quantized
there.

Block-scaled checkpoints are read dequantized too and, on CUDA, quantized again per output channel: this
build has no block-scaled GEMM of its own (a dequant fallback to rowwise `_scaled_mm`), so their numerics
are per-channel FP8's, not the checkpoint's blocks'.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tandem.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine.quant.fp8_format import FP8, FP8_MAX, dequantize, quantize_per_channel


def scaled_mm_fits(weight: torch.Tensor) -> bool:
    """`_scaled_mm` takes in and out features that are multiples of 16."""
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


class Fp8MatMul:
    """The `MatMul` of a linear layer whose weight is FP8 [N, K] with float32 scales [N]:
    x -> per-token FP8 (scale = the row's largest magnitude / 448) -> `_scaled_mm` in the input dtype."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale.reshape(1, -1).float().contiguous()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k).float()
        x_scale = (x2.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        xq = (x2 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        # weight.t() of a row-major [N, K] is the column-major [K, N] the kernel wants.
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*lead, -1)


def quantize_linears(
    modules: Iterable[ColumnParallelLinear | RowParallelLinear], *, on_gpu: bool, round_trip: bool
) -> int:
    """Make `modules` (column- or row-parallel linears, loaded in the compute dtype) FP8.

    On GPU: the weight becomes FP8 with per-channel scales and the layer's GEMM `Fp8MatMul`. On CPU with
    `round_trip` (dynamic FP8 from a bf16 checkpoint): the weight is rounded through FP8 and back in
    place; without it (an FP8 checkpoint, already dequantized) nothing changes. Returns the layers made
    FP8 on GPU (shapes `_scaled_mm` cannot take keep the compute dtype)."""
    made = 0
    for module in modules:
        weight = module.weight
        if not on_gpu:
            if round_trip:
                weight.data.copy_(dequantize(*quantize_per_channel(weight.data)))
            continue
        if not scaled_mm_fits(weight):
            continue
        wq, scale = quantize_per_channel(weight.data)
        module.weight = nn.Parameter(wq, requires_grad=False)
        module.matmul = Fp8MatMul(scale)
        module.tinygemm_fits = False  # tinygemm takes bf16 weights
        made += 1
    return made
