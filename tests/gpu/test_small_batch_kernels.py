"""The kernels of small decode graphs chained as the engine chains them, inside a CUDA graph, with
programmatic dependent launch: the Triton add + RMS norm, flashinfer's tinygemm in place of cuBLAS (the
o/down shape of Llama-3.1-8B, where FusedKernels picks it) or tandem's Triton GEMV, and the Triton
SiLU-and-multiply. Against the
same chain in float32 torch ops, then over many replays: a kernel that read its input before the kernel
writing it finished (a wrong PDL wait) would change the output from one replay to the next."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HIDDEN = 4096  # 256 tinygemm CTAs: the one-to-two-wave shape FusedKernels gives to tinygemm on an H200
LINKS = 12  # chain links per graph: each reads what the one before it wrote


@pytest.mark.parametrize("gemm", ["tinygemm", "gemv"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_pdl_chain_matches_float32_and_replays(rows: int, gemm: str) -> None:
    from tandem.engine.kernel_plan import KernelPlanner
    from tandem.engine.layers.fused import FusedKernels

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL and tinygemm need compute capability 9.0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if 2 * sms < HIDDEN // 16:
        pytest.skip("tinygemm is not picked for this shape on this GPU's SM count")
    kernels = FusedKernels(16, triton=True, tinygemm=True)
    gemv_rows = 8 if gemm == "gemv" else 0
    plan = KernelPlanner(
        fused_decode_rows=8, triton_norm_rows=8, pdl_rows=8, tinygemm_rows=8, gemv_rows=gemv_rows
    ).decode(rows)
    assert plan.triton_norms and plan.pdl and plan.tinygemm and plan.gemv == (gemm == "gemv")
    matmul = kernels.gemv if plan.gemv else kernels.tinygemm
    g = torch.Generator(device="cuda").manual_seed(rows)
    weight = torch.randn(HIDDEN, HIDDEN, device="cuda", generator=g).bfloat16() * HIDDEN**-0.5
    assert kernels.tinygemm_fits(weight) and kernels.gemv_fits(weight)
    norm_w = (torch.rand(HIDDEN, device="cuda", generator=g) + 0.5).bfloat16()
    start = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
    residual_start = torch.randn_like(start)

    def chain(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        for _ in range(LINKS):
            normed, residual = kernels.add_rmsnorm(x, residual, norm_w, 1e-6, gemma=False, plan=plan)
            merged = matmul(normed, weight, None, plan)  # [rows, HIDDEN] as gate | up halves
            act = kernels.act_and_mul(merged, gelu=False, plan=plan)
            x = matmul(F.pad(act, (0, HIDDEN // 2)), weight, None, plan)
        return x

    def reference() -> torch.Tensor:
        x, residual = start.float(), residual_start.float()
        for _ in range(LINKS):
            residual = residual + x
            normed = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()
            gate, up = (normed @ weight.float().T).chunk(2, -1)
            x = F.pad(F.silu(gate) * up, (0, HIDDEN // 2)) @ weight.float().T
        return x

    x, residual = start.clone(), residual_start.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = chain(x, residual).clone()  # the warm-up: probes tinygemm's shapes
        assert kernels.tinygemm_shapes() == ({} if plan.gemv else {(rows, HIDDEN, HIDDEN, False): True})
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            x.copy_(start)
            residual.copy_(residual_start)
            out = chain(x, residual)
    torch.cuda.current_stream().wait_stream(stream)
    truth = reference()
    scale = float(truth.pow(2).mean().sqrt())
    assert float((eager.float() - truth).abs().max()) < 0.1 * scale
    graph.replay()
    first = out.clone()
    assert torch.equal(first, eager)
    for _ in range(30):
        graph.replay()
        assert torch.equal(out, first)


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_gemv_in_a_graph_matches_the_dequantized_matmul(rows: int, block: tuple[int, int] | None) -> None:
    """Weight-only FP8 decode: the GEMV over FP8 bytes with per-channel or 128 x 128 block scales, under
    PDL inside a CUDA graph, at Llama-3.1-8B's down-projection shape, against the float32 product with the
    dequantized weight (one bf16 rounding, plus summation order), bit-stable over replays."""
    from tandem.engine.kernel_plan import KernelPlanner
    from tandem.engine.layers.fused import FusedKernels
    from tandem.engine.layers.weight_scales import WeightScales
    from tandem.engine.quant.fp8_format import quantize_blocks, quantize_per_channel

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 and PDL need compute capability 9.0")
    kernels = FusedKernels(16, triton=True, tinygemm=False)
    plan = KernelPlanner(fused_decode_rows=8, triton_norm_rows=8, pdl_rows=8, gemv_rows=8).decode(rows)
    g = torch.Generator(device="cuda").manual_seed(rows)
    weight = torch.randn(4096, 14336, device="cuda", generator=g) * 14336**-0.5
    if block is None:
        wq, values = quantize_per_channel(weight)
        scales = WeightScales(values.contiguous())
    else:
        wq, values = quantize_blocks(weight, block)
        scales = WeightScales(values.contiguous(), block)
    assert kernels.gemv_fits(wq, scales) and not kernels.gemv_fits(wq)
    x = torch.randn(rows, 14336, device="cuda", generator=g).bfloat16()
    want = x.float() @ scales.dequantize(wq).T
    graph = torch.cuda.CUDAGraph()
    kernels.gemv(x, wq, None, plan, None, scales)  # compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = kernels.gemv(x, wq, None, plan, None, scales)
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert float(((first.float() - want).abs() / ulp).max()) <= 1.0
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
