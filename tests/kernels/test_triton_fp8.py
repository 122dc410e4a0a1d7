"""The one-launch per-token FP8 quantizer (engine/quant/triton_fp8.py) against torch, in Triton's CPU
interpreter: rows wider than the block and not a multiple of it, strided rows, an all-zero row (the scale's
floor). The scales must agree exactly, and so must the FP8 values, except where the interpreter's own
float-to-FP8 conversion departs from the GPU's (and torch's): it rounds a value half way between two FP8
numbers away from zero instead of to even, one that rounds up to a power of two lands an octave low, and
FP8's subnormals come out as zero.
tests/gpu checks the kernel's FP8 values on the device through the GEMMs that read them. Skips without
Triton."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CASES = [(3, 1500, 512), (2, 64, 1024), (4, 4096, 1024)]  # (rows, width, block)
SCRIPT = """
import json, sys, torch
from tandem.engine.quant.triton_fp8 import quantize_per_token

results = []
for rows, k, block in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(k)
    wide = (torch.randn(rows, k + 16, generator=g) * 3).to(torch.bfloat16)
    wide[-1] = 0  # the scale's floor
    x = wide[:, :k]  # strided rows
    q, scale = quantize_per_token(x, block=block)
    want_scale = (x.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    scaled = (x.float() / want_scale).clamp(-448, 448)
    want = scaled.to(torch.float8_e4m3fn).float()
    got = q.float()
    tie = (got - scaled).abs() == (want - scaled).abs()
    power_of_two = want.abs().log2() == want.abs().log2().round()
    octave = power_of_two & (scaled.abs() < want.abs()) & (got == want / 2)
    subnormal = (got == 0) & (want.abs() < 2**-6)
    explained = (got == want) | tie | octave | subnormal
    results.append([
        float((scale - want_scale).abs().max()), bool(explained.all()), float((got == want).float().mean()),
        list(q.shape), str(q.dtype),
    ])
print(json.dumps(results))
"""


def test_matches_torch_in_the_interpreter(triton_interpreter: Callable[[str, object], Any]) -> None:
    results = triton_interpreter(SCRIPT, CASES)
    assert len(results) == len(CASES)
    for (rows, k, _), (scale_error, explained, equal, shape, dtype) in zip(CASES, results):
        assert scale_error == 0.0
        assert explained
        assert equal > 0.9  # the interpreter's departures are rare
        assert shape == [rows, k] and dtype == "torch.float8_e4m3fn"
