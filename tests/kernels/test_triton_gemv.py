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
