"""FP8 linear layers: weights in float8_e4m3fn, GEMMs with 16-bit activations in and out, on CUDA.

Two library GEMMs, chosen once per engine (`EngineConfig.fp8_gemm`):
- `"block"` (Hopper): flashinfer's `fp8_blockscale_gemm_sm90` (DeepGEMM's kernels). It takes the bf16
  activations and quantizes them itself, per token and 128 columns, inside the GEMM, and scales the
  weights per 128 x 128 block: block-scaled checkpoints keep their own blocks. Per-channel weights
  (dynamic FP8, channel-scaled checkpoints) run there with unit block scales and their channel scales
  applied to the output, so they keep per-channel numerics (the kernel reads its weight scales as blocks
  whatever their shape), up to `BLOCK_ROUTE_MAX_ROWS` rows; larger inputs take `_scaled_mm` below,
  which is faster there (`ChannelScaledMatMul`, benchmarks/kernels/fp8_gemm.py).
- `"scaled_mm"` (other FP8 GPUs, or shapes the block kernel refuses): per-token activation scales from
  one Triton launch, then `torch._scaled_mm` with per-channel weight scales.

On CPU the weights stay in the compute dtype: FP8 checkpoints are read dequantized (fp8_format.py) and
`quantization="fp8"` rounds them through FP8 and back, so a CPU run is exactly the model whose weights are
the dequantized FP8 ones, the reference HF transformers runs in the tests. Activations are not quantized
there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine.layers.weight_scales import WeightScales
from tandem.engine.quant.fp8_format import dequantize, quantize_blocks, quantize_per_channel

BLOCK = 128  # the block kernel's K granule, and the block size of the checkpoints it serves as is


def scaled_mm_fits(weight: torch.Tensor) -> bool:
    """`_scaled_mm` takes in and out features that are multiples of 16."""
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


def block_gemm_fits(weight: torch.Tensor) -> bool:
    """The block kernel takes K a multiple of 128 and N a multiple of 64."""
    n, k = weight.shape
    return n % 64 == 0 and k % BLOCK == 0


class BlockScaledMatMul:
    """The `MatMul` of a linear layer whose weight is FP8 [N, K]: flashinfer's SM90 block-scaled GEMM over
    `blocks`, float32 [ceil(N / 128), K / 128], then, for per-channel weights, `channel` (float32 [N])
    on the output (their blocks' scales are all 1)."""

    def __init__(self, blocks: torch.Tensor, channel: torch.Tensor | None = None) -> None:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90  # CUDA only: imported when a layer is made

        self._gemm: Any = fp8_blockscale_gemm_sm90
        self.blocks = blocks.float().contiguous()
        self.channel = None if channel is None else channel.float().contiguous()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.bfloat16 or not x2.is_contiguous():
            x2 = x2.to(torch.bfloat16).contiguous()
        out = self._gemm(x2, weight, None, self.blocks, out_dtype=torch.bfloat16)
        if self.channel is not None:  # in place: the product in float32, rounded once
            out.mul_(self.channel)
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).view(*lead, -1)  # type: ignore[no-any-return]


class ScaledMatMul:
    """The `MatMul` of a linear layer whose weight is FP8 [N, K] with float32 scales [N]:
    x -> per-token FP8 (one Triton launch) -> `torch._scaled_mm` in the input dtype."""

    def __init__(self, scale: torch.Tensor) -> None:
        from tandem.engine.quant.triton_fp8 import quantize_per_token  # CUDA only, like Triton

        self._quantize = quantize_per_token
        self.scale = scale.reshape(1, -1).float().contiguous()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        xq, x_scale = self._quantize(x.reshape(-1, k).contiguous())
        # weight.t() of a row-major [N, K] is the column-major [K, N] the kernel wants.
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*lead, -1)


# Rows up to which per-channel FP8 runs on the block kernel (unit blocks, channel scales on its output);
# above, `_scaled_mm` with per-token activation scales. On an H200 the block route won at 1-16 rows and
# `_scaled_mm` from 256 rows up, and by far at prefill sizes, where the block route's extra pass over
# the output costs as much as the FP8 GEMM saves (fp8-h200.json: `gemm_kernels`, `gemm_kernels_by_rows`).
BLOCK_ROUTE_MAX_ROWS = 64


class ChannelScaledMatMul:
    """The `MatMul` of a per-channel FP8 weight [N, K] (float32 scales [N]) on Hopper: the block kernel for
    decode-sized inputs, `_scaled_mm` for larger ones. Both read the same FP8 weight; the choice is by
    the input's rows, fixed for each CUDA graph since its shapes are."""

    def __init__(self, channel: torch.Tensor, n: int, k: int) -> None:
        unit = torch.ones(-(-n // BLOCK), k // BLOCK, device=channel.device)
        self.small = BlockScaledMatMul(unit, channel)
        self.large = ScaledMatMul(channel)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        route = self.small if rows <= BLOCK_ROUTE_MAX_ROWS else self.large
        return route(x, weight, bias)


def quantize_linears(
    modules: Iterable[ColumnParallelLinear | RowParallelLinear],
    *,
    gemm: str | None,
    round_trip: bool,
    block: tuple[int, int] | None = None,
) -> int:
    """Make `modules` (column- or row-parallel linears, loaded in the compute dtype) FP8.

    `gemm` is the engine's FP8 GEMM ("block" or "scaled_mm"), None on CPU. On CPU with `round_trip`
    (dynamic FP8 from a 16-bit checkpoint) each weight is rounded through FP8 and back in place; without
    it (an FP8 checkpoint, read dequantized) nothing changes. On GPU the weight becomes FP8 again: in the
    checkpoint's 128 x 128 blocks where it has them and the block GEMM runs (the same blocks' FP8 values
    back, for a checkpoint whose scales are its blocks' largest magnitudes over 448), per output channel
    otherwise. Returns the layers made FP8 on GPU; shapes neither GEMM takes keep the compute dtype."""
    made = 0
    for module in modules:
        weight = module.weight
        if gemm is None:
            if round_trip:
                weight.data.copy_(dequantize(*quantize_per_channel(weight.data)))
            continue
        matmul: BlockScaledMatMul | ChannelScaledMatMul | ScaledMatMul
        if gemm == "block" and block_gemm_fits(weight):
            n, k = weight.shape
            if block == (BLOCK, BLOCK):
                wq, blocks = quantize_blocks(weight.data, block)
                matmul = BlockScaledMatMul(blocks)
            else:
                wq, channel = quantize_per_channel(weight.data)
                matmul = ChannelScaledMatMul(channel, n, k)
        elif scaled_mm_fits(weight):
            wq, channel = quantize_per_channel(weight.data)
            matmul = ScaledMatMul(channel)
        else:
            continue
        module.weight = nn.Parameter(wq, requires_grad=False)
        module.matmul = matmul
        module.tinygemm_fits = False  # tinygemm takes 16-bit weights
        # The Triton GEMV reads the FP8 bytes and scales them in registers (weight-only: the activations
        # stay 16-bit), under the plans that run the GEMV (one-row decode graphs by default).
        scales = _gemv_scales(matmul)
        module.gemv_scales = scales
        module.gemv_fits = module.kernels is not None and module.kernels.gemv_fits(wq, scales)
        made += 1
    return made


def _gemv_scales(matmul: BlockScaledMatMul | ChannelScaledMatMul | ScaledMatMul) -> WeightScales:
    """The scales the GEMV reads for a layer's FP8 weight, the same the layer's library GEMM applies."""
    if isinstance(matmul, BlockScaledMatMul):
        return WeightScales(matmul.blocks, (BLOCK, BLOCK))
    if isinstance(matmul, ChannelScaledMatMul):
        return WeightScales(matmul.large.scale.reshape(-1).contiguous())
    return WeightScales(matmul.scale.reshape(-1).contiguous())
