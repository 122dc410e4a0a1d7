"""The fused MoE kernels' MXFP4 option (W4A16: packed e2m1 weights and e8m0 scales unpacked inside the
kernels) against dequantize-then-matmul, in Triton's CPU interpreter: the one- and two-token GEMVs
(both launch plans) and the grouped GEMMs, with gpt-oss's options (top-k-then-softmax routing, biases,
the clamped SwiGLU), a tensor-parallel shard with and without the down bias, and an expert-parallel one;
and the plain SiLU experts. The kernels read the packed bytes in tiles of whole 32-value blocks, so the
shapes include reductions that are a multiple of 32 but not of the K step (whose last step the masks cut
short), those also at other K steps (the GEMVs' 64, the GEMMs' smallest, 32, and 64). Scales are
followed in memory by e8m0's NaN, so a scale read past the end of the weights shows.

Random bytes draw every e2m1 code (both zeros, both signs); the scales span several powers of two. The
grouped GEMMs run in float16 here, as in test_triton_moe.py (the interpreter's bf16 tl.dot is wrong);
the GEMVs in bf16. Skips without Triton (CI)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def cases(rows: list[tuple[int, int, int, bool, bool, int, int]], steps: bool) -> list[dict[str, Any]]:
    """tokens, rank, ranks, expert parallel, gpt-oss's options, hidden, expert intermediate; `steps`:
    also at other K steps than the engine's."""
    return [{"T": t, "rank": r, "size": n, "ep": ep, "gptoss": gptoss, "H": h, "I": i, "steps": steps}
            for t, r, n, ep, gptoss, h, i in rows]  # fmt: skip


BASE = cases(
    [
        (1, 0, 1, False, True, 64, 64),
        (2, 1, 2, False, True, 64, 64),  # TP: the second slice, no down bias
        (2, 1, 2, True, True, 64, 64),
        (1, 0, 1, False, False, 64, 64),
        (37, 0, 2, False, True, 64, 64),  # TP: the first slice, with the down bias
        (37, 1, 2, False, True, 64, 64),
        (37, 1, 2, True, True, 64, 64),
        (37, 0, 1, False, False, 64, 64),
    ],
    steps=False,
)
# Reductions a multiple of 32 but not of the K step (the masks): 160 = 5 blocks of 32, 96 = 3, TP slices
# of 3 blocks; gpt-oss-20b's ratio, 2880 = 90 blocks, at a tenth: 288 = 9 blocks.
MASKS = cases(
    [
        (1, 0, 1, False, True, 160, 96),
        (2, 1, 2, False, True, 160, 192),
        (2, 0, 1, False, False, 288, 288),
        (9, 0, 1, False, True, 160, 96),
        (9, 1, 2, False, True, 160, 192),
        (9, 0, 2, True, True, 288, 288),
    ],
    steps=True,
)
SCRIPT = """
import json, sys, torch
from tandem.engine.moe.fused import SMALL_MAX_TOKENS, FusedMoE, GemmBlocks, SmallBlocks
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.mxfp4 import dequantize

E, k = 8, 2
out = []
for c in json.loads(sys.argv[1]):
    T, H, I = c["T"], c["H"], c["I"]
    small = T <= SMALL_MAX_TOKENS
    dtype = torch.bfloat16 if small else torch.float16
    g = torch.Generator().manual_seed(T * 7 + c["rank"] + 3 * c["ep"])
    gptoss = c["gptoss"]
    options = dict(scoring="topk_softmax", router_bias=True, expert_bias=True, activation="swiglu_clamped",
                   swiglu_limit=1.0, gpt_oss_layout=True) if gptoss else {}
    spec = MoESpec(E, k, I, not gptoss, (True,), **options)
    shard = ExpertShard.of(spec, c["rank"], c["size"], expert_parallel=c["ep"])
    lo, n, e0, el = shard.inter_start, shard.inter_size, shard.expert_start, shard.num_local

    def packed(rows, cols):  # the kernels' layout: [E, rows, cols / 2] bytes, [E, rows, cols / 32] scales
        blocks = torch.randint(0, 256, (E, rows, cols // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(121, 126, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        return blocks, scales

    def fenced(scales):  # followed in memory by e8m0's NaN (255): a scale read past the end reads NaN
        memory = torch.full((scales.numel() + 64,), 255, dtype=torch.uint8)
        memory[:scales.numel()] = scales.flatten()
        return memory[:scales.numel()].view(scales.shape)

    full13, full13_s = packed(2 * I, H)
    full2, full2_s = packed(H, I)
    # This rank's shard: whole experts e0.., the rows (gate, then up) of its intermediate slice, and the
    # down projection's K columns of that slice (whole 32-blocks: lo and n are multiples of 32).
    rows13 = torch.cat([torch.arange(lo, lo + n), torch.arange(I + lo, I + lo + n)])
    w13, s13 = full13[e0:e0 + el, rows13].contiguous(), full13_s[e0:e0 + el, rows13].contiguous()
    w2 = full2[e0:e0 + el, :, lo // 2:(lo + n) // 2].contiguous()
    s2 = full2_s[e0:e0 + el, :, lo // 32:(lo + n) // 32].contiguous()
    s13, s2 = fenced(s13), fenced(s2)
    dense13 = dequantize(w13.view(el, 2 * n, H // 32, 16), s13)
    dense2 = dequantize(w2.view(el, H, n // 32, 16), s2)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g).to(dtype)
    b13 = b2 = None
    if gptoss:
        b13 = torch.randn(el, 2 * n, generator=g).to(dtype)
        b2 = torch.randn(el, H, generator=g).to(dtype)
    fused = FusedMoE(spec, shard, H)
    got = fused(x, logits, w13, w2, None, None, False, b13, b2, s13, s2).float()
    weights, ids = reference_choice(logits, k, renormalize=spec.renormalize, scoring=spec.scoring)
    want = reference_experts(x, weights, ids, dense13, dense2, expert_start=e0, spec=spec if gptoss else None,
                             b13=b13, b2=b2 if lo == 0 else None)
    def err(o):
        return float((o.float() - want).abs().max() / want.abs().max())

    result = {"err": err(got), "small": small, "nonzero": float(want.abs().max())}
    if small:
        own = fused._small(x, logits, w13, w2, None, None, blocks=SmallBlocks(routed=False),
                           biases=(b13, b2), scales=(s13, s2))
        result["err_unrouted"] = err(own)
    if small and c["steps"]:
        # K steps of 64 (several, the last one partial where the reduction is no multiple of 64).
        steps = fused._small(x, logits, w13, w2, None, None, blocks=SmallBlocks(up_bk=64, down_bk=64),
                             biases=(b13, b2), scales=(s13, s2))
        result["err_steps"] = err(steps)
    elif c["steps"]:
        # The smallest K step the kernels take (32: each half a tl.dot of K 16), and one of 64.
        for bk in (32, 64):
            tile = GemmBlocks(16, 32, bk, 1, 4, 2)
            routing = fused.route(logits, (tile, tile))
            pairs = fused.expert_gemms(x, routing, w13, w2, (b13, b2), (s13, s2))
            result[f"err_bk{bk}"] = err(fused.sum(pairs, routing))
    out.append(result)
print(json.dumps(out))
"""


# One interpreter process each, so each stays well within the runner's time limit on a loaded machine.
@pytest.mark.parametrize("batch", [BASE, MASKS[:3], MASKS[3:]], ids=["base", "masks-small", "masks-grouped"])
def test_mxfp4_experts_match_dequantize_then_matmul_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any], batch: list[dict[str, Any]]
) -> None:
    results = triton_interpreter(SCRIPT, batch)
    assert [r["small"] for r in results] == [c["T"] <= 2 for c in batch]
    for case, r in zip(batch, results):
        # One rounding of the activation and of each pair's row: bf16 ~ 2^-8, fp16 ~ 2^-11.
        bound = 2e-2 if r["small"] else 4e-3
        assert r["nonzero"] > 0 and r["err"] < bound, (case, r)
        others = ["err_unrouted"] if r["small"] else []
        if case["steps"]:
            others += ["err_steps"] if r["small"] else ["err_bk32", "err_bk64"]
        assert all(r[key] < bound for key in others), (case, r)


MODEL_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from tandem import LLM, SamplingParams
from tandem.engine.moe.fused import FusedMoE
from tandem.engine.moe.layer import MoE
from tandem.engine.quant.mxfp4 import Mxfp4Checkpoint

mxfp4_dir, dense_dir = json.loads(sys.argv[1])
# What the engine chooses on CUDA with Triton: the experts stay packed.
Mxfp4Checkpoint.resident = staticmethod(lambda device, *, triton: True)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 13, 40)]
llm = LLM(mxfp4_dir, device="cpu", chunk_size=16)
layers = [m for m in llm.runtime.engine.model.modules() if isinstance(m, MoE)]
for m in layers:  # the kernels the engine sets up on CUDA
    m.experts.fused = FusedMoE(m.experts.spec, m.shard, m.experts.hidden_size)
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
hf = AutoModelForCausalLM.from_pretrained(dense_dir, attn_implementation="eager").eval()
want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        for p in prompts]
print(json.dumps({"packed": [str(m.experts.w13.dtype) for m in layers],
                  "same": [o.token_ids == w for o, w in zip(outs, want)]}))
"""


def test_a_whole_mxfp4_gpt_oss_on_the_kernels_gives_hf_greedy_tokens(
    triton_interpreter: Callable[[str, object], Any],
    tiny_model_dir: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """A tiny gpt-oss in the hub's MXFP4 layout, its experts held packed and run by the kernels' MXFP4
    option in float32 (prefill chunks and decode steps of one to three rows: both paths), gives HF's
    greedy tokens on the dequantized weights."""
    from ..engine.test_mxfp4 import write_mxfp4

    write_mxfp4(tiny_model_dir("gpt_oss"), tmp_path / "dense", tmp_path / "mxfp4")
    out = triton_interpreter(MODEL_SCRIPT, [str(tmp_path / "mxfp4"), str(tmp_path / "dense")])
    assert out == {"packed": ["torch.uint8"] * 4, "same": [True, True, True]}


def test_mxfp4_weights_must_hold_the_layers_reduction() -> None:
    """A launch's packed rows are checked against the layer's K (the kernels read whole 32-value blocks of
    exactly that many values a row), and the blocks against their scales."""
    pytest.importorskip("triton")
    from tandem.engine.moe.fused import weight_options

    w, s = torch.zeros(2, 8, 48, dtype=torch.uint8), torch.zeros(2, 8, 3, dtype=torch.uint8)
    assert weight_options(w, s, reduction=96)["MXFP4"]
    with pytest.raises(ValueError, match="rows of 96 values, the layer's are 160"):
        weight_options(w, s, reduction=160)
    with pytest.raises(ValueError, match="MXFP4 experts: blocks"):
        weight_options(w, s[..., :2], reduction=96)
