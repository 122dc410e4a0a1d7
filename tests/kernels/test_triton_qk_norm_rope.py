"""The fused q/k norm + rope kernel (engine/layers/qk_norm_rope.py) against the engine's torch
reference modules (RMSNorm, GemmaRMSNorm, RotaryEmbedding), in float32 in Triton's CPU interpreter:
with the norms and without (the rope alone), with k returned, and with k and v written into a paged
cache at each token's slot.

Skips where Triton is not installed (CI); kernel_choices.py checks it against flashinfer on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (tokens, q heads, kv heads, head_dim, gemma, block_h, norm): Qwen3-like, a head count the block does
# not divide, Gemma 3's one KV head; then the rope alone (no q/k norms: Llama-like), as the kernel runs
# for models without per-head norms.
CASES = [
    (5, 4, 2, 16, False, 4, True),
    (3, 6, 1, 32, True, 4, True),
    (1, 3, 3, 8, False, 8, True),
    (4, 8, 2, 16, False, 8, False),
    (2, 3, 1, 8, False, 4, False),
]
SCRIPT = """
import json, sys, torch
from tandem.engine.layers.qk_norm_rope import qk_norm_rope
from tandem.engine.config import RopeConfig
from tandem.engine.layers.norm import GemmaRMSNorm, RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding

errors, append = [], []
for t, h, kvh, d, gemma, bh, norm in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(t * 10 + h)
    cls = GemmaRMSNorm if gemma else RMSNorm
    q_norm, k_norm = (cls(d, 1e-6, dtype=torch.float32, device=torch.device("cpu")) for _ in range(2))
    q_norm.weight.data.copy_(torch.randn(d, generator=g))
    k_norm.weight.data.copy_(torch.randn(d, generator=g))
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), d, torch.device("cpu"))
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3
    positions = torch.randint(0, 4000, (t,), generator=g)
    q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.reshape(t, h, d), k.reshape(t, kvh, d)
    want_q, want_k = rotary(positions, q_norm(q), k_norm(k)) if norm else rotary(positions, q, k)
    qw, kw = (q_norm.weight, k_norm.weight) if norm else (None, None)
    freqs = torch.arange(4096).float().unsqueeze(-1) * rotary.inv_freq.unsqueeze(0)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    got_q, got_k = qk_norm_rope(qkv, positions, qw, kw, table, num_heads=h,
                                num_kv_heads=kvh, eps=1e-6, gemma=gemma, block_h=bh)
    errors.append(max(float((got_q - want_q).abs().max()), float((got_k - want_k).abs().max())))
    # The append form: k and v land at the tokens' slots of a paged cache; the other slots stay.
    slots = torch.randperm(4 * t, generator=g)[:t]
    k_cache, v_cache = torch.zeros(4 * t, kvh, d), torch.zeros(4 * t, kvh, d)
    got_q, _ = qk_norm_rope(qkv, positions, qw, kw, table, num_heads=h,
                            num_kv_heads=kvh, eps=1e-6, gemma=gemma, block_h=bh,
                            kv_cache=(k_cache, v_cache, slots))
    others = torch.ones(4 * t, dtype=torch.bool)
    others[slots] = False
    append.append({
        "q": float((got_q - want_q).abs().max()),
        "k": float((k_cache[slots] - want_k).abs().max()),
        "v_exact": bool(torch.equal(v_cache[slots], qkv[:, (h + kvh) * d:].reshape(t, kvh, d))),
        "others_untouched": bool(k_cache[others].eq(0).all() and v_cache[others].eq(0).all()),
    })
print(json.dumps([errors, append]))
"""


def test_matches_the_torch_norms_and_rope_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    errors, append = triton_interpreter(SCRIPT, CASES)
    assert len(errors) == len(CASES) and max(errors) < 1e-4, errors
    assert len(append) == len(CASES)
    for case in append:
        assert case["q"] < 1e-4 and case["k"] < 1e-4, case
        assert case["v_exact"] and case["others_untouched"], case
