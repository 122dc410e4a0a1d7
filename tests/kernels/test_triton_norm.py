"""The Triton residual add + RMS norm (engine/layers/triton_norm.py) against the torch reference
(engine/layers/norm.py's math), in float32 in Triton's CPU interpreter: with and without the residual,
the Llama and Gemma scales, a row width that is not a power of two, and strided rows (a view into a
wider tensor). Skips where Triton is not installed (CI)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (rows, width, gemma, add)
CASES = [(1, 64, False, True), (3, 48, True, True), (5, 64, False, False), (2, 40, True, False)]
SCRIPT = """
import json, sys, torch
from tandem.engine.layers.triton_norm import add_rmsnorm

results = []
for rows, n, gemma, add in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(rows * n)
    wide = torch.randn(rows, n + 16, generator=g)
    border = torch.cat((wide[:, :8], wide[:, 8 + n :]), 1).clone()
    x = wide[:, 8 : 8 + n]  # strided rows
    residual = torch.randn(rows, n, generator=g)
    w = torch.randn(n, generator=g)
    total = residual + x if add else x.clone()
    want = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * ((1 + w) if gemma else w)
    got = add_rmsnorm(x, residual if add else None, w, 1e-6, gemma=gemma)
    results.append({
        "error": float((got - want).abs().max()),
        "residual_error": float((residual - total).abs().max()) if add else 0.0,
        "in_place": bool(got.data_ptr() == x.data_ptr()) if add else True,
        "border_untouched": bool(torch.equal(torch.cat((wide[:, :8], wide[:, 8 + n :]), 1), border)),
    })
print(json.dumps(results))
"""


def test_matches_the_torch_norm_in_the_interpreter(triton_interpreter: Callable[[str, object], Any]) -> None:
    results = triton_interpreter(SCRIPT, CASES)
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results):
        assert result["error"] < 1e-5, (case, result)
        assert result["residual_error"] < 1e-6, (case, result)
        assert result["in_place"], (case, result)
        assert result["border_untouched"], (case, result)  # only the row's own columns were written
