"""The one-launch split-KV decode attention candidate (benchmarks/triton_decode_attention.py) against SDPA
over the same paged KV, in float32 in Triton's CPU interpreter: GQA groups that are and are not a power
of two, rows shorter than the split count (empty splits), partial last pages, and a second launch that
finds the tickets back at zero.

Skips where Triton is not installed (CI); kernel_choices.py times it on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (heads, kv heads, head_dim, page size, splits, context lengths per row)
CASES = [
    (8, 2, 16, 4, 4, [13, 1, 40]),
    (6, 2, 8, 4, 8, [5, 33]),
    (4, 4, 16, 8, 2, [64, 9, 17, 8]),
]
SCRIPT = """
import json, sys, torch
import torch.nn.functional as F
from tandem.benchmarks.triton_decode_attention import TritonDecodeAttention

results = []
for h, kvh, d, page, splits, ctx in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(h * 100 + splits)
    per_row = [-(-c // page) for c in ctx]
    num_pages = sum(per_row) + 3
    k_cache = torch.randn(num_pages, page, kvh, d, generator=g)
    v_cache = torch.randn(num_pages, page, kvh, d, generator=g)
    order = torch.randperm(num_pages, generator=g).to(torch.int32)
    indptr = torch.tensor([0] + per_row).cumsum(0).to(torch.int32)
    indices = order[: sum(per_row)]
    last = torch.tensor([c - (n - 1) * page for c, n in zip(ctx, per_row)], dtype=torch.int32)
    q = torch.randn(len(ctx), h, d, generator=g)
    scale = d ** -0.5
    attend = TritonDecodeAttention(len(ctx), h, kvh, d, splits=splits, device="cpu")
    runs = [attend(q, (k_cache, v_cache), indptr, indices, last, scale) for _ in range(2)]
    errors = []
    for b, c in enumerate(ctx):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        keys = k_cache[pages].reshape(-1, kvh, d)[:c].transpose(0, 1).repeat_interleave(h // kvh, 0)
        values = v_cache[pages].reshape(-1, kvh, d)[:c].transpose(0, 1).repeat_interleave(h // kvh, 0)
        want = F.scaled_dot_product_attention(q[b].unsqueeze(1), keys, values, scale=scale).squeeze(1)
        errors.append(max(float((run[b] - want).abs().max()) for run in runs))
    results.append({"error": max(errors), "tickets_reset": bool(attend.tickets.eq(0).all())})
print(json.dumps(results))
"""


def test_matches_sdpa_over_the_paged_kv_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    results = triton_interpreter(SCRIPT, CASES)
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results):
        assert result["error"] < 1e-4, (case, result)
        assert result["tickets_reset"], (case, result)
