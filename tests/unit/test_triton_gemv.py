"""The Triton small-batch GEMM candidate (benchmarks/triton_gemv.py) against F.linear, in Triton's CPU
interpreter: ragged and even block edges, the bias, and the block-config choice.

Triton is not a project dependency (CUDA builds of torch bring it along), so this skips where it is
not installed, as in CI; kernel_choices.py checks the same kernel against F.linear on the GPU. The
interpreter is chosen when a kernel is decorated and patches triton.language globally, so it runs in
its own process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (m, n, k, block_n, block_k, bias): ragged N and K, an even case, one row, all eight rows.
CASES = [
    (1, 48, 96, 16, 32, False),
    (3, 40, 100, 8, 64, True),
    (8, 33, 64, 16, 32, True),
    (5, 16, 7, 4, 8, False),
    (2, 64, 128, 8, 64, True),
]
SCRIPT = """
import json, sys, torch
import torch.nn.functional as F
from tandem.benchmarks.triton_gemv import GemvConfig, gemv, m_pad, pick_config

def err(a, b):
    return float((a - b).abs().max())

out = {"cases": []}
for m, n, k, bn, bk, with_bias in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(m * 100 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    out["cases"].append(err(gemv(x, w, b, config=GemvConfig(bn, bk, 4)), F.linear(x, w, b)))
try:
    gemv(torch.randn(9, 16), torch.randn(16, 16), config=GemvConfig(4, 16, 4))
    out["rejected"] = "accepted 9 rows"
except ValueError as exc:
    out["rejected"] = str(exc)
picks = [
    (m, n, k, pick_config(m, n, k, 132))
    for m in (1, 3, 8) for n, k in ((6144, 4096), (4096, 14336), (1024, 3072), (48, 20))
]
out["picks_fit"] = all(c.fits(m_pad(m)) and c.block_k <= max(k, 64) * 2 for m, n, k, c in picks)
pow2 = [c.block_n & (c.block_n - 1) == 0 and c.block_k & (c.block_k - 1) == 0 for *_, c in picks]
out["picks_pow2"] = all(pow2)
print(json.dumps(out))
"""


def test_matches_linear_with_bias_and_ragged_edges_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    out = triton_interpreter(SCRIPT, CASES)
    assert len(out["cases"]) == len(CASES) and max(out["cases"]) < 1e-4, out["cases"]
    assert "M <= 8" in out["rejected"]
    assert out["picks_fit"] and out["picks_pow2"]
