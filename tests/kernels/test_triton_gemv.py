"""The Triton GEMV of one-row decode graphs (engine/layers/triton_gemv.py) against a float32 matmul, in
Triton's CPU interpreter: every output within one bf16 rounding of the float32 product, at feature counts
that are not a multiple of a program's block, widths that are not powers of two, strided rows, a bias, and
several rows; and which weights it takes. Skips without Triton (CI); kernel_choices.py's `chain` part times
it in whole decode layers on the GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CASES = [  # (rows, out features, in features, bias)
    (1, 64, 1024, False),  # 16 features a program
    (3, 40, 96, True),  # a partial last block; K padded to 128
    (2, 6, 3000, True),  # 4 features a program, K padded to 4,096
]
SCRIPT = """
import json, sys, torch
from tandem.engine.layers.triton_gemv import block_n, fits, gemv

out = {"cases": []}
for rows, n, k, bias in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    wide = torch.randn(rows, k + 8, generator=g).to(torch.bfloat16)
    x = wide[:, :k]  # strided rows
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    want = x.float() @ w.float().T + (b.float() if bias else 0.0)
    got = gemv(x, w, b).float()
    # One bf16 rounding of the float32 result: within a unit in the last place (the interpreter's
    # conversion truncates; the GPU's rounds to nearest), plus summation order.
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    out["cases"].append({"shape": list(got.shape), "worst": float(((got - want).abs() / ulp).max()),
                         "block": block_n(k)})
bf16 = torch.empty(8, 64, dtype=torch.bfloat16)
wide_k = torch.empty(8, 20000, dtype=torch.bfloat16)
out["fits"] = [fits(bf16), fits(bf16.float()), fits(bf16.t()), fits(wide_k)]
try:
    gemv(torch.empty(1, 32, dtype=torch.bfloat16), bf16)
    out["rejects_width"] = False
except ValueError:
    out["rejects_width"] = True
print(json.dumps(out))
"""


def test_within_one_rounding_of_float32_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    out = triton_interpreter(SCRIPT, CASES)
    assert [c["shape"] for c in out["cases"]] == [[rows, n] for rows, n, _, _ in CASES]
    assert [c["block"] for c in out["cases"]] == [16, 16, 4]
    worst = [c["worst"] for c in out["cases"]]
    assert max(worst) <= 1.0, worst
    # 16-bit and contiguous only, K up to 16,384; a mismatched input width is an error, not garbage.
    assert out["fits"] == [True, False, False, False]
    assert out["rejects_width"]


FOLD_CASES = [  # (slots of the rows, in features, slice widths): -1 is a row without an adapter
    ([0], 1024, [64]),  # one row, one slice, 16 features a program
    ([1, -1, 0], 3000, [24, 8, 8]),  # a base row between two adapters; three slices; 4 features a program
]
FOLD_SCRIPT = """
import json, sys, torch
import numpy as np
from tandem.engine.kernel_plan import KernelPlan
from tandem.engine.layers.triton_gemv import gemv, takes_delta
from tandem.engine.lora.batch import LoraBatchBuffers
from tandem.engine.lora.delta import LoraContext, LoraDelta, TorchLoraOps
from tandem.engine.lora.layout import LinearLayout, LoraSlice
from tandem.engine.lora.triton_lora import TritonLoraOps

S, R = 3, 8
out = {"cases": []}
for row_slots, k, widths in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(k)
    n = sum(widths)
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    pieces = tuple(LoraSlice(f"p{i}", o, w, 0) for i, (o, w) in enumerate(zip(offsets, widths)))
    layout = LinearLayout(0, len(widths) == 1, pieces, k, 0, n, R, 0, 0)
    # float16: the interpreter's bfloat16 tl.dot (the shrink) is wrong; the GPU runs bfloat16.
    w = torch.randn(n, k, generator=g).half()
    a = (torch.randn(S, layout.a_rows, k, generator=g) / k**0.5).half()
    b = torch.randn(S, n, R, generator=g).half()
    rows = len(row_slots)
    x = torch.randn(rows + 1, k, generator=g).half()  # and a row of padding, as a graph's batch has
    buffers = LoraBatchBuffers(16, S, torch.device("cpu"))
    # A full batch first, so the slots past the next one's rows are stale unless cleared.
    buffers.write(np.array([2] * 16, dtype=np.int32), np.ones(16, dtype=np.int32))
    buffers.write(np.array(row_slots, dtype=np.int32), np.ones(len(row_slots), dtype=np.int32))
    plan = KernelPlan(rows=rows + 1, gemv=True, lora=True)
    want = gemv(x[:rows], w)
    LoraDelta(a, b, layout, LoraContext(buffers), TorchLoraOps()).add(x[:rows], want, plan)
    folded = LoraDelta(a, b, layout, LoraContext(buffers), TritonLoraOps()).fold(x, plan)
    base_rows = [i for i, s in enumerate(row_slots) if s < 0] + [rows]
    folded.partial[:, base_rows] = float("nan")  # never written for a base row or padding: not read
    got = gemv(x, w, delta=folded)
    scale = want.float().abs().max()
    out["cases"].append({"err": float((got[:rows].float() - want.float()).abs().max() / scale),
                         "base_same": bool(torch.equal(got[base_rows], gemv(x, w)[base_rows])),
                         "takes": takes_delta(w, offsets)})
out["misaligned"] = takes_delta(torch.empty(16, 3000, dtype=torch.half), [0, 6])
print(json.dumps(out))
"""


def test_a_folded_lora_delta_matches_the_separate_one_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    """The GEMV's epilogue adds a LoRA delta (engine/layers/low_rank.py) from the shrink's partials, as
    the separate expand would: rows of two adapters, a base row and a padding row whose partials are NaN
    and stay unread (the padding's slot is stale from an earlier batch unless the buffers clear it),
    three slices; a slice that starts inside a program's block is not folded."""
    out = triton_interpreter(FOLD_SCRIPT, FOLD_CASES)
    for case in out["cases"]:
        assert case["takes"] and case["base_same"], case
        assert case["err"] < 2e-3, case  # 16-bit rounding of the output, once against twice
    assert out["misaligned"] is False


FP8_CASES = [  # (rows, out features, in features, block or None for per-channel scales)
    (1, 64, 1024, None),
    (2, 40, 96, None),  # a partial last block of features; K padded to 128
    (1, 300, 1000, [128, 128]),  # edge scale blocks on both sides; K padded to 1,024
    (3, 48, 96, [16, 32]),  # small blocks, several rows
    (1, 20, 64, [128, 128]),  # K smaller than one scale block: padded up to it
]
FP8_SCRIPT = """
import json, sys, torch
from tandem.engine.layers.triton_gemv import fits, gemv
from tandem.engine.layers.weight_scales import WeightScales
from tandem.engine.quant.fp8_format import quantize_blocks, quantize_per_channel

out = {"cases": []}
for rows, n, k, block in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different ranges
    if block is None:
        wq, values = quantize_per_channel(w)
        scales = WeightScales(values.contiguous())
    else:
        wq, values = quantize_blocks(w, tuple(block))
        scales = WeightScales(values.contiguous(), tuple(block))
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    want = x.float() @ scales.dequantize(wq).T
    got = gemv(x, wq, None, scales=scales).float()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    out["cases"].append({"shape": list(got.shape), "worst": float(((got - want).abs() / ulp).max()),
                         "fits": fits(wq, scales), "fits_unscaled": fits(wq)})
print(json.dumps(out))
"""


def test_fp8_weights_are_scaled_in_the_kernel(triton_interpreter: Callable[[str, object], Any]) -> None:
    """Weight-only FP8: the GEMV reads FP8 bytes and their per-channel or per-block scales, and gives the
    float32 product with the dequantized weight, rounded once to bf16 (plus summation order)."""
    out = triton_interpreter(FP8_SCRIPT, FP8_CASES)
    assert [c["shape"] for c in out["cases"]] == [[rows, n] for rows, n, _, _ in FP8_CASES]
    worst = [c["worst"] for c in out["cases"]]
    assert max(worst) <= 1.0, worst
    # An FP8 weight fits only with its scales.
    assert all(c["fits"] and not c["fits_unscaled"] for c in out["cases"])
