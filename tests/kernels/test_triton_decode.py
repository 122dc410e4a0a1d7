"""The one-launch small-batch decode (engine/attention/triton_decode.py) against a torch reference, in float32
in Triton's CPU interpreter: q/k norms (plain and Gemma) or none, the rope at each row's position, the new
K/V written at its slot, attention over the row's earlier paged tokens plus the new one, GQA groups that are
and are not a power of two, rows with no earlier token or fewer blocks than splits, partial last pages, and
a second launch that finds the tickets back at zero. The interpreter runs programs one after another, so
it checks the math, not the tickets' ordering under real concurrency (tests/gpu does that).

Skips where Triton is not installed (CI).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (heads, kv heads, head_dim, page size, splits, block_n, norm ("", "plain", "gemma"), earlier tokens per row)
CASES = [
    (8, 2, 32, 4, 4, 16, "", [13, 0, 40]),
    (6, 2, 32, 8, 8, 16, "plain", [5, 70]),
    (4, 4, 32, 4, 2, 32, "gemma", [63, 9, 17, 1]),
    (4, 1, 32, 8, 1, 16, "", [33, 2]),
    (6, 2, 32, 8, 1, 16, "gemma", [5, 70, 33]),
]
SCRIPT = """
import json, sys, torch
import torch.nn.functional as F
from tandem.engine.attention.triton_decode import DecodeScratch, decode_rope_attention

def rms(x, w, gemma):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return x * ((1 + w) if gemma else w)

def rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

results = []
for h, kvh, d, page, splits, block_n, norm, old in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(h * 100 + splits)
    rows = len(old)
    per_row = [c // page + 1 for c in old]  # earlier tokens plus the new one
    num_pages = sum(per_row) + 3
    k_cache = torch.randn(num_pages * page, kvh, d, generator=g)
    v_cache = torch.randn(num_pages * page, kvh, d, generator=g)
    order = torch.randperm(num_pages, generator=g).to(torch.int32)
    indptr = torch.tensor([0] + per_row).cumsum(0).to(torch.int32)
    indices = order[: sum(per_row)]
    slots = torch.tensor(
        [int(indices[indptr[b] + c // page]) * page + c % page for b, c in enumerate(old)], dtype=torch.int32
    )
    positions = torch.tensor([c + 7 for c in old])  # absolute positions: a prefix was evicted or offset
    table_len = max(positions) + 1
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(table_len).float()[:, None] * inv[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), -1)
    qkv = torch.randn(rows, (h + 2 * kvh) * d, generator=g)
    qw = torch.randn(d, generator=g) if norm else None
    kw = torch.randn(d, generator=g) if norm else None
    scratch = DecodeScratch.allocate(
        max_bs=rows, max_row_splits=rows * splits, num_heads=h, num_kv_heads=kvh,
        head_dim=d, device="cpu",
    )
    before_k, before_v = k_cache.clone(), v_cache.clone()
    scale = d ** -0.5
    outs = [
        decode_rope_attention(
            qkv, positions, qw, kw, table, (k_cache, v_cache), (indptr, indices),
            torch.tensor(old, dtype=torch.int32), slots, scratch, num_heads=h, num_kv_heads=kvh,
            eps=1e-6, gemma=norm == "gemma", scale=scale,
            page_size=page, splits=splits, block_n=block_n,
        )
        for _ in range(2)
    ]
    errors, store_errors = [], []
    for b, c in enumerate(old):
        q, k, v = qkv[b].split([h * d, kvh * d, kvh * d])
        q, k, v = q.view(h, d), k.view(kvh, d), v.view(kvh, d)
        if norm:
            q, k = rms(q, qw, norm == "gemma"), rms(k, kw, norm == "gemma")
        cos, sin = table[positions[b], : d // 2], table[positions[b], d // 2 :]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        pages = indices[indptr[b]:indptr[b + 1]].long()
        flat = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:c]
        keys = torch.cat((before_k[flat], k[None]), 0).transpose(0, 1).repeat_interleave(h // kvh, 0)
        values = torch.cat((before_v[flat], v[None]), 0).transpose(0, 1).repeat_interleave(h // kvh, 0)
        want = F.scaled_dot_product_attention(q.unsqueeze(1), keys, values, scale=scale)
        want = want.squeeze(1).reshape(-1)
        errors.append(max(float((out[b] - want).abs().max()) for out in outs))
        slot = int(slots[b])
        store_errors.append(max(float((k_cache[slot] - k).abs().max()),
                                float((v_cache[slot] - v).abs().max())))
    written = torch.zeros(k_cache.shape[0], dtype=torch.bool)
    written[slots.long()] = True
    untouched = bool(k_cache[~written].eq(before_k[~written]).all()
                     and v_cache[~written].eq(before_v[~written]).all())
    results.append({
        "error": max(errors), "store_error": max(store_errors), "untouched": untouched,
        "tickets_reset": bool(scratch.tickets.eq(0).all()),
    })
print(json.dumps(results))
"""


def test_matches_the_torch_chain_in_the_interpreter(triton_interpreter: Callable[[str, object], Any]) -> None:
    results = triton_interpreter(SCRIPT, CASES)
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results):
        assert result["error"] < 1e-4, (case, result)
        assert result["store_error"] < 1e-5, (case, result)
        assert result["untouched"], (case, result)  # only the new tokens' slots were written
        assert result["tickets_reset"], (case, result)


def test_launch_config_follows_the_h200_timings() -> None:
    pytest = __import__("pytest")
    triton_decode = pytest.importorskip("tandem.engine.attention.triton_decode")
    # (batch, KV heads) -> (splits, block): the best measured per batch (kernel-choices-decode-fused.json).
    expected = {1: (16, 32), 2: (8, 64), 4: (4, 64), 8: (8, 64), 16: (4, 64), 32: (2, 64), 64: (1, 64)}
    for batch, config in expected.items():
        assert triton_decode.launch_config(batch, 8, 132) == config, batch
