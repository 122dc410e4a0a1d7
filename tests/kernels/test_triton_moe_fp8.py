"""The fused MoE kernels' FP8 option (W8A16: float8_e4m3fn weights with float32 scales per block, scaled
inside the kernels) against dequantize-then-matmul, in Triton's CPU interpreter: the one- and two-token
GEMVs (both launch plans, one reduction step and several) and the grouped GEMMs, at the checkpoints'
128 x 128 blocks, for a whole layer, a tensor-parallel shard of each half, an expert-parallel one, an
intermediate size that ends in a partial block, and smaller blocks whose rows a GEMM tile spans several
of; and a whole tiny Qwen3-MoE with FP8 experts on the kernels against HF.

The grouped GEMMs run in float16 here, as in test_triton_moe.py (the interpreter's bf16 tl.dot is
wrong); the GEMVs in bf16. Skips without Triton (CI)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CASES: list[dict[str, Any]] = [
    {"T": t, "rank": r, "size": n, "ep": ep, "I": i, "block": block}
    for t, r, n, ep, i, block in [
        (1, 0, 1, False, 256, [128, 128]),
        (2, 1, 2, False, 256, [128, 128]),  # TP: the second slice of the intermediate dimension
        (2, 1, 2, True, 256, [128, 128]),
        (1, 0, 1, False, 192, [128, 128]),  # a partial last block of the intermediate dimension
        (1, 0, 1, False, 256, [16, 32]),
        (37, 0, 2, False, 256, [128, 128]),
        (37, 1, 2, False, 256, [128, 128]),
        (37, 1, 2, True, 256, [128, 128]),
        (37, 0, 1, False, 192, [128, 128]),
        (37, 0, 1, False, 256, [16, 32]),  # a 64-column tile spans four block rows
    ]
]
SCRIPT = """
import json, sys, torch
from tandem.engine.layers.weight_scales import WeightScales
from tandem.engine.moe.fused import SMALL_MAX_TOKENS, FusedMoE, SmallBlocks
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.fp8_format import quantize_blocks

E, k, H = 8, 2, 256
out = []
for c in json.loads(sys.argv[1]):
    T, I, block = c["T"], c["I"], tuple(c["block"])
    small = T <= SMALL_MAX_TOKENS
    dtype = torch.bfloat16 if small else torch.float16
    g = torch.Generator().manual_seed(T * 7 + c["rank"] + 3 * c["ep"] + I)
    spec = MoESpec(E, k, I, True, (True,))
    shard = ExpertShard.of(spec, c["rank"], c["size"], expert_parallel=c["ep"])
    lo, n, e0, el = shard.inter_start, shard.inter_size, shard.expert_start, shard.num_local

    def fp8(rows, cols):  # blocks of ranges a power of two apart, so a wrong block's scale shows
        ranges = 2.0 ** torch.randint(-2, 3, (-(-rows // block[0]), -(-cols // block[1])), generator=g)
        spread = ranges.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        w = torch.randn(rows, cols, generator=g) * spread / cols**0.5
        return quantize_blocks(w, block)

    # Every expert's gate, up and down as a checkpoint holds them; then this rank's shard of each, as
    # MoEExperts loads it: the rows (gate, up) or columns (down) of its slice and their blocks' scales.
    w13, s13, w2, s2, dense13, dense2 = [], [], [], [], [], []
    b0, b1 = block
    for e in range(e0, e0 + el):
        gate, up, down = fp8(I, H), fp8(I, H), fp8(H, I)
        rows = [(wq[lo:lo + n], s[lo // b0:-(-(lo + n) // b0)]) for wq, s in (gate, up)]
        w13.append(torch.cat([r[0] for r in rows]))
        s13.append(torch.cat([r[1] for r in rows]))
        w2.append(down[0][:, lo:lo + n])
        s2.append(down[1][:, lo // b1:-(-(lo + n) // b1)])
        dense13.append(torch.cat([WeightScales(s, block).dequantize(wq) for wq, s in rows]))
        dense2.append(WeightScales(s2[-1], block).dequantize(w2[-1]))
    w13, s13 = torch.stack(w13).contiguous(), torch.stack(s13).contiguous()
    w2, s2 = torch.stack(w2).contiguous(), torch.stack(s2).contiguous()
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g).to(dtype)
    fused = FusedMoE(spec, shard, H)
    got = fused(x, logits, w13, w2, None, None, False, s13=s13, s2=s2, fp8_block=block).float()
    weights, ids = reference_choice(logits, k, renormalize=True)
    want = reference_experts(x, weights, ids, torch.stack(dense13), torch.stack(dense2), expert_start=e0)
    result = {"err": float((got - want).abs().max() / want.abs().max()), "small": small,
              "nonzero": float(want.abs().max()), "fp8": str(w13.dtype)}
    if small:
        # Routing for themselves, in reduction steps of 128 (several, each of whole blocks), and more
        # outputs a program (fewer programs for the interpreter).
        steps = SmallBlocks(routed=False, up_bn=4, up_bk=128, down_bn=8, down_bk=128)
        own = fused._small(x, logits, w13, w2, None, None, blocks=steps,
                           scales=(s13, s2), fp8_block=block)
        result["err_unrouted"] = float((own.float() - want).abs().max() / want.abs().max())
    out.append(result)
print(json.dumps(out))
"""


@pytest.mark.parametrize("small", [True, False], ids=["gemv", "grouped"])
def test_fp8_experts_match_dequantize_then_matmul_in_the_interpreter(
    small: bool, triton_interpreter: Callable[[str, object], Any]
) -> None:
    cases = [c for c in CASES if (c["T"] <= 2) == small]  # one interpreter process each, kept short
    results = triton_interpreter(SCRIPT, cases)
    assert [r["small"] for r in results] == [small] * len(cases)
    for case, r in zip(cases, results):
        assert r["fp8"] == "torch.float8_e4m3fn"
        # One rounding of the activation and of each pair's row: bf16 ~ 2^-8, fp16 ~ 2^-11.
        bound = 2e-2 if r["small"] else 4e-3
        assert r["nonzero"] > 0 and r["err"] < bound, (case, r)
        if r["small"]:
            assert r["err_unrouted"] < bound, (case, r)


MODEL_SCRIPT = """
import json, sys, torch
from tandem import LLM, SamplingParams
from tandem.engine.moe.fused import FusedMoE
from tandem.engine.moe.layer import MoE
from tandem.engine.quant.fp8_format import Fp8Checkpoint

fp8_dir, prompts, want = json.loads(sys.argv[1])
# What the engine chooses on CUDA with Triton: the experts stay FP8.
Fp8Checkpoint.expert_block = lambda self, device, *, triton: self.block
llm = LLM(fp8_dir, device="cpu", chunk_size=16)
layers = [m for m in llm.runtime.engine.model.modules() if isinstance(m, MoE)]
for m in layers:  # the kernels the engine sets up on CUDA
    m.experts.fused = FusedMoE(m.experts.spec, m.shard, m.experts.hidden_size)
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
print(json.dumps({"held": [str(m.experts.w13.dtype) for m in layers],
                  "same": [o.token_ids == w[:12] for o, w in zip(outs, want)]}))
"""


def test_a_whole_fp8_qwen3_moe_on_the_kernels_gives_hf_greedy_tokens(
    triton_interpreter: Callable[[str, object], Any],
    tiny_model_dir: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """A tiny Qwen3-MoE with block-scaled FP8 experts, held in FP8 and run by the kernels' FP8 option
    in float32 (prefill chunks and decode steps of one to three rows: both paths), gives HF's greedy
    tokens on the dequantized weights."""
    from ..engine.test_fp8_experts import fp8_case

    case = fp8_case(tiny_model_dir("qwen3_moe"), tmp_path)
    prompts, want = case["prompts"][:3], case["want"][:3]
    out = triton_interpreter(MODEL_SCRIPT, [str(case["dir"]), prompts, want])
    layers = len(out["held"])
    assert layers > 0 and out == {"held": ["torch.float8_e4m3fn"] * layers, "same": [True] * 3}
