"""The candidate Triton SiLU-and-multiply (engine/layers/triton_act.py) against torch in float32, in Triton's
CPU interpreter: a width that is not a multiple of the block, and strided rows. Skips without Triton (CI);
kernel_choices.py's `act` part times it against flashinfer's kernel on the GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CASES = [(1, 100, 64), (3, 256, 128)]  # (rows, width of gate and of up, block)
SCRIPT = """
import json, sys, torch
import torch.nn.functional as F
from tandem.engine.layers.triton_act import silu_and_mul

results = []
for rows, n, block in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n)
    wide = torch.randn(rows, 2 * n + 8, generator=g)
    x = wide[:, : 2 * n]  # strided rows
    want = F.silu(x[:, :n]) * x[:, n:]
    results.append(float((silu_and_mul(x, block=block) - want).abs().max()))
print(json.dumps(results))
"""


def test_matches_torch_in_the_interpreter(triton_interpreter: Callable[[str, object], Any]) -> None:
    errors = triton_interpreter(SCRIPT, CASES)
    assert len(errors) == len(CASES)
    assert max(errors) < 1e-5, errors
