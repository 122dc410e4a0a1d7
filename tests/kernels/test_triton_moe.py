"""The fused MoE kernels (engine/moe/fused.py) against the plain per-expert reference, in Triton's CPU
interpreter: the one- and two-token path (both its launch plans) and the grouped path (routing, grouping
by expert, both GEMMs, the top-k sum), with router logits full of ties, experts that get no token, top-k
renormalized or not, a shared expert, a tensor-parallel shard and an expert-parallel one; and the grouped
path's schedule itself (each local pair once, in pair order within its expert, blocks padded with the
sentinel).

The grouped GEMMs run in float16 here: the interpreter of Triton 3.9 multiplies bfloat16 tiles in
tl.dot wrongly (its numpy emulation), so bf16 is covered on the GPU (tests/gpu/test_moe_gpu.py); the
one- and two-token path, which has no tl.dot, runs in bf16 here too. Skips without Triton (CI)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

CASES: list[dict[str, Any]] = [
    # tokens, experts, k, hidden, intermediate, renormalize, rank, ranks, expert parallel, ties, shared, dtype
    {"T": 1, "E": 8, "k": 2, "H": 64, "I": 48, "renorm": True, "rank": 0, "size": 1, "ep": False},
    {
        "T": 2,
        "E": 8,
        "k": 3,
        "H": 64,
        "I": 48,
        "renorm": False,
        "rank": 1,
        "size": 2,
        "ep": True,
        "shared": True,
    },
    {
        "T": 2,
        "E": 8,
        "k": 2,
        "H": 80,
        "I": 40,
        "renorm": True,
        "rank": 1,
        "size": 2,
        "ep": False,
        "ties": True,
    },
    {
        "T": 1,
        "E": 8,
        "k": 2,
        "H": 64,
        "I": 48,
        "renorm": True,
        "rank": 0,
        "size": 1,
        "ep": False,
        "dtype": "float16",
    },
    {"T": 5, "E": 8, "k": 2, "H": 64, "I": 48, "renorm": True, "rank": 0, "size": 1, "ep": False},
    {
        "T": 37,
        "E": 8,
        "k": 3,
        "H": 64,
        "I": 48,
        "renorm": False,
        "rank": 1,
        "size": 2,
        "ep": True,
        "ties": True,
        "shared": True,
    },
    {
        "T": 37,
        "E": 8,
        "k": 3,
        "H": 64,
        "I": 48,
        "renorm": False,
        "rank": 1,
        "size": 2,
        "ep": False,
        "ties": True,
        "shared": True,
    },
    # 75 pairs per expert: the 64-row blocks, three routing programs.
    {"T": 300, "E": 16, "k": 4, "H": 96, "I": 80, "renorm": True, "rank": 0, "size": 1, "ep": False},
    # gpt-oss's options: top-k-then-softmax routing, biases (the down bias on the first slice's rank
    # only), the clamped SwiGLU; both paths, a TP shard with and without the down bias, and EP.
    *(
        {
            "T": t,
            "E": 8,
            "k": 2,
            "H": 64,
            "I": 48,
            "renorm": False,
            "rank": r,
            "size": 2,
            "ep": ep,
            "ties": ties,
            "gptoss": True,
        }
        for t, r, ep, ties in [
            (1, 0, False, False),
            (2, 1, False, True),
            (2, 1, True, False),
            (37, 0, False, True),
            (37, 1, False, False),
            (37, 1, True, False),
        ]
    ),
]
SCRIPT = """
import json, sys, torch
from tandem.engine.moe.fused import SMALL_MAX_TOKENS, FusedMoE, SmallBlocks
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec

out = []
for c in json.loads(sys.argv[1]):
    T, E, k, H, I = c["T"], c["E"], c["k"], c["H"], c["I"]
    small = T <= SMALL_MAX_TOKENS
    dtype = getattr(torch, c.get("dtype", "bfloat16" if small else "float16"))
    g = torch.Generator().manual_seed(T * 7 + E)
    gptoss = c.get("gptoss", False)
    options = dict(scoring="topk_softmax", router_bias=True, expert_bias=True, activation="swiglu_clamped",
                   swiglu_limit=1.0, gpt_oss_layout=True) if gptoss else {}
    spec = MoESpec(E, k, I, c["renorm"], (True,), **options)
    shard = ExpertShard.of(spec, c["rank"], c["size"], expert_parallel=c["ep"])
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    if c.get("ties"):
        logits = torch.randint(0, 3, (T, E), generator=g).to(dtype)
    else:
        logits = torch.randn(T, E, generator=g).to(dtype)
    lo, n, e0, el = shard.inter_start, shard.inter_size, shard.expert_start, shard.num_local
    mine13 = torch.cat([w13[e0:e0 + el, lo:lo + n], w13[e0:e0 + el, I + lo:I + lo + n]], 1).contiguous()
    mine2 = w2[e0:e0 + el, :, lo:lo + n].contiguous()
    shared = torch.randn(T, H, generator=g).to(dtype) if c.get("shared") else None
    gate = torch.randn(T, 1, generator=g).to(dtype) if c.get("shared") else None
    b13 = b2 = None
    if gptoss:
        full13, full2 = torch.randn(E, 2 * I, generator=g).to(dtype), torch.randn(E, H, generator=g).to(dtype)
        b13 = torch.cat([full13[e0:e0 + el, lo:lo + n], full13[e0:e0 + el, I + lo:I + lo + n]], 1)
        b2 = full2[e0:e0 + el].contiguous()
        b13 = b13.contiguous()
    fused = FusedMoE(spec, shard, H)
    got = fused(x, logits, mine13, mine2, shared, gate, False, b13, b2).float()
    weights, ids = reference_choice(logits, k, renormalize=c["renorm"], scoring=spec.scoring)
    want = reference_experts(x, weights, ids, mine13, mine2, expert_start=e0, spec=spec if gptoss else None,
                             b13=b13, b2=b2 if lo == 0 else None)
    if shared is not None:
        want = want + torch.sigmoid(gate.float()) * shared.float()
    # Relative to the output's scale: the kernels round the activation and each pair's row once.
    result = {"err": float((got - want).abs().max() / want.abs().max()), "small": small,
              "empty_experts": E - len(set(ids.flatten().tolist()))}
    if small:  # the other launch plan: every up and down program routes its token itself
        own = fused._small(x, logits, mine13, mine2, shared, gate, blocks=SmallBlocks(routed=False),
                           biases=(b13, b2))
        result["err_unrouted"] = float((own.float() - want).abs().max() / want.abs().max())
    else:
        r = fused.route(logits)
        result["ids"] = torch.equal(r.ids.long(), ids)
        result["weights"] = float((r.weights - weights).abs().max())
        bm, total = r.up.bm, int(r.total)
        slots = r.sorted_pairs[:total].tolist()
        local = [p for p in range(T * k) if e0 <= int(ids.flatten()[p]) < e0 + el]
        real = [s for s in slots if s != T * k]
        layout_ok = sorted(real) == local and total % bm == 0
        for b in range(total // bm):  # each block holds pairs of its own expert, in pair order
            block = [s for s in slots[b * bm:(b + 1) * bm] if s != T * k]
            layout_ok &= all(int(ids.flatten()[s]) - e0 == int(r.block_experts[b]) for s in block)
            layout_ok &= block == sorted(block)
        result["layout"] = layout_ok
    out.append(result)
print(json.dumps(out))
"""


def test_fused_moe_matches_the_reference_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    results = triton_interpreter(SCRIPT, CASES)
    assert [r["small"] for r in results] == [c["T"] <= 2 for c in CASES]
    # One rounding of the model dtype on the activation and on each pair's row: bf16 ~ 2^-8, fp16 ~ 2^-11.
    for case, r in zip(CASES, results):
        bound = 2e-2 if case.get("dtype", "bfloat16" if case["T"] <= 2 else "float16") == "bfloat16" else 4e-3
        assert r["err"] < bound, (case, r)
        if r["small"]:
            assert r["err_unrouted"] < bound, (case, r)
        if not r["small"]:
            assert r["ids"] and r["weights"] < 1e-6 and r["layout"], (case, r)
    assert results[0]["empty_experts"] >= 6 and results[4]["empty_experts"] >= 1  # experts with no token


MODEL_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from tandem import LLM, SamplingParams
from tandem.engine.moe.fused import FusedMoE
from tandem.engine.moe.layer import MoE

model_dir = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 13, 40)]
llm = LLM(model_dir, device="cpu", chunk_size=16)
layers = [m for m in llm.runtime.engine.model.modules() if isinstance(m, MoE)]
for m in layers:  # what the engine sets up on CUDA
    m.experts.fused = FusedMoE(m.experts.spec, m.shard, m.experts.hidden_size)
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        for p in prompts]
print(json.dumps({"layers": len(layers), "same": [o.token_ids == w for o, w in zip(outs, want)]}))
"""


@pytest.mark.parametrize(
    ("family", "layers"), [("qwen2_moe", 3), ("gpt_oss", 4), ("deepseek_v2", 3), ("deepseek_v3", 3)]
)
def test_a_whole_model_on_the_fused_path_gives_hf_greedy_tokens(
    triton_interpreter: Callable[[str, object], Any],
    tiny_model_dir: Callable[..., Any],
    family: str,
    layers: int,
) -> None:
    """Qwen2-MoE (a shared expert, a dense layer), gpt-oss (top-k-then-softmax routing, biases, the
    clamped SwiGLU) and DeepSeek-V2/V3 (grouped routers, whose choice the kernels are given, and an
    ungated shared expert) in float32 with every MoE layer on the Triton kernels: prefill chunks and
    decode steps of one to three rows take both paths."""
    out = triton_interpreter(MODEL_SCRIPT, str(tiny_model_dir(family)))
    assert out == {"layers": layers, "same": [True, True, True]}
