"""The one-launch decode (engine/attention/triton_decode.py) on the GPU, in bf16, against a float32
torch reference on the same inputs: Llama's head layout (no q/k norms) and Qwen3's (norms), at the split
counts the engine picks for 1 to 32 rows (32: uneven lengths), including rows with no earlier token (a
decode graph's padding rows). Then a CUDA graph
of many back-to-back launches, replayed: the splits race for their tickets for real, and every replay must
give the same output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 16
D = 128


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


@pytest.mark.parametrize(("heads", "kv_heads", "norm"), [(32, 8, False), (16, 8, True)])
@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_matches_float32_and_survives_graph_replays(heads: int, kv_heads: int, norm: bool, rows: int) -> None:
    from tandem.engine.attention.triton_decode import DecodeScratch, decode_rope_attention, launch_config

    g = torch.Generator(device="cuda").manual_seed(rows)
    old = [700, 0, 33, 511, 16, 1, 250, 95][:rows]
    if rows > len(old):  # uneven rows, as in an offline run's large decode batches, and a padding row
        lens = torch.randint(1, 2000, (rows - 1,), generator=torch.Generator().manual_seed(rows))
        old = [0, *lens.tolist()]
    per_row = [c // PAGE + 1 for c in old]
    num_pages = sum(per_row) + 1
    k_cache = torch.randn(num_pages * PAGE, kv_heads, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn_like(k_cache)
    indices = torch.randperm(num_pages, device="cuda", generator=g)[: sum(per_row)].to(torch.int32)
    indptr = torch.tensor([0, *per_row], device="cuda").cumsum(0).to(torch.int32)
    slots = torch.stack([indices[indptr[b] + c // PAGE] * PAGE + c % PAGE for b, c in enumerate(old)])
    positions = torch.tensor(old, device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.arange(2048, device="cuda").float()[:, None] * inv[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), -1)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * D, device="cuda", dtype=torch.bfloat16, generator=g)
    qw = kw = None
    if norm:
        qw = torch.rand(D, device="cuda", generator=g).to(torch.bfloat16) + 0.5
        kw = torch.rand(D, device="cuda", generator=g).to(torch.bfloat16) + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits, block_n = launch_config(rows, kv_heads, sms)
    scratch = DecodeScratch.allocate(
        max_bs=rows, max_row_splits=rows * splits, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=D, device="cuda",
    )  # fmt: skip
    before_k, before_v = k_cache.float(), v_cache.float()
    out = torch.empty(rows, heads * D, device="cuda", dtype=torch.bfloat16)
    old_lens = torch.tensor(old, device="cuda", dtype=torch.int32)

    def launch() -> None:
        decode_rope_attention(
            qkv, positions, qw, kw, table, (k_cache, v_cache), (indptr, indices),
            old_lens, slots, scratch,
            num_heads=heads, num_kv_heads=kv_heads, eps=1e-6, gemma=False, scale=D**-0.5,
            page_size=PAGE, splits=splits, block_n=block_n, out=out,
        )  # fmt: skip

    launch()
    want = torch.empty(rows, heads * D, device="cuda")
    for b, c in enumerate(old):
        q, k, v = qkv[b].float().split([heads * D, kv_heads * D, kv_heads * D])
        q, k, v = q.view(heads, D), k.view(kv_heads, D), v.view(kv_heads, D)
        if qw is not None and kw is not None:
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * qw.float()
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * kw.float()
        cos, sin = table[c, : D // 2], table[c, D // 2 :]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        pages = indices[indptr[b] : indptr[b + 1]].long()
        flat = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)[:c]
        group = heads // kv_heads
        keys = torch.cat((before_k[flat], k[None]), 0).transpose(0, 1).repeat_interleave(group, 0)
        values = torch.cat((before_v[flat], v[None]), 0).transpose(0, 1).repeat_interleave(group, 0)
        want[b] = F.scaled_dot_product_attention(q.unsqueeze(1), keys, values).reshape(-1)
        # The new token's K/V went to its slot, rounded once to bf16.
        assert torch.allclose(k_cache[slots[b]].float(), k, atol=0.05, rtol=0.02), b
        assert torch.equal(v_cache[slots[b]].float(), v), b
    err = float((out.float() - want).abs().max())
    assert err < 0.03, f"max error {err} against float32 (bf16 inputs, outputs in [-3, 3])"
    assert bool(scratch.tickets.eq(0).all())

    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(16):
            launch()
    for _ in range(30):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), "a replay merged before every split had written its partial"
    assert bool(scratch.tickets.eq(0).all())
