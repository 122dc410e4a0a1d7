"""The candidate small-M GEMM (benchmarks/triton_gemv.py) against torch, in Triton's CPU interpreter.

Triton is not a project dependency (CUDA builds of torch bring it along), so this skips where it is
not installed; kernel_choices.py checks the same kernel against F.linear on the GPU. The interpreter is
chosen when a kernel is decorated and patches triton.language globally, so it runs in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = [(1, 48, 96, 16, 32), (3, 40, 100, 8, 64), (8, 33, 64, 16, 32), (5, 16, 7, 4, 8)]
SCRIPT = """
import json, sys, torch
from tandem.benchmarks.triton_gemv import gemv
out = []
for m, n, k, bn, bk in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(m * 100 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    out.append(float((gemv(x, w, block_n=bn, block_k=bk) - x @ w.t()).abs().max()))
try:
    gemv(torch.randn(9, 16), torch.randn(16, 16))
    out.append("accepted 9 rows")
except ValueError as exc:
    out.append(str(exc))
print(json.dumps(out))
"""


def test_matches_linear_including_ragged_edges_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    *errors, rejected = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == len(CASES) and max(errors) < 1e-4, errors
    assert "M <= 8" in rejected
