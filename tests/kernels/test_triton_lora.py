"""The batched LoRA kernels (engine/lora/triton_lora.py) against a per-row PyTorch reference, in Triton's
CPU interpreter: a merged three-slice layer (slices of different widths, none a multiple of a program's
block) and a row layer; decode-sized batches (one input stretch per program) and prefill-sized ones (the
looped form), rows of several slots interleaved with base rows, in float32 and float16 (the interpreter's
bfloat16 `tl.dot` is wrong; tests/gpu/test_lora_gpu.py runs bfloat16 on the device); the torch
reference path and a longer small-batch stretch (`LoraLaunch`) on the same cases. The rows without a
slot must come back unchanged. Skips without Triton."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CASES = [  # (rows, extend lengths, slots per row)
    ("decode", [1] * 7, [0, -1, 2, 0, 1, -1, 2]),
    ("one row", [1], [1]),
    ("prefill", [40, 1, 23, 9], [2, -1, 0, 2]),
    ("long prefill", [290, 11], [1, 2]),  # wider expand blocks, one split
]
SCRIPT = """
import json, sys, torch
import numpy as np
from tandem.engine.kernel_plan import KernelPlan
from tandem.engine.lora.batch import LoraBatchBuffers
from tandem.engine.lora.delta import LoraContext, LoraDelta, TorchLoraOps
from tandem.engine.lora.layout import LinearLayout, LoraSlice
from tandem.engine.lora.triton_lora import LoraLaunch, TritonLoraOps

S, R = 3, 8
layers = {
    "merged": (LinearLayout(0, False, (LoraSlice("q_proj", 0, 40, 0), LoraSlice("k_proj", 40, 24, 0),
                                       LoraSlice("v_proj", 64, 24, 0)), 96, 0, 88, R, 0, 0), 96),
    "row": (LinearLayout(0, True, (LoraSlice("o_proj", 0, 72, 0),), 300, 0, 72, R, 0, 0), 300),
}
out = []
for name, lens, slots in json.loads(sys.argv[1]):
    for kind, (layout, k) in layers.items():
        for dtype in (torch.float32, torch.float16):  # the interpreter's bf16 tl.dot is wrong; GPU: tests/gpu
            g = torch.Generator().manual_seed(len(lens) * 7 + k)
            a = torch.randn(S, layout.a_rows, k, generator=g).to(dtype)
            b = torch.randn(S, layout.out_features, R, generator=g).to(dtype)
            tokens = sum(lens)
            x = torch.randn(tokens, k, generator=g).to(dtype)
            base = torch.randn(tokens, layout.out_features, generator=g).to(dtype)
            buffers = LoraBatchBuffers(512, S, torch.device("cpu"))
            buffers.write(np.array(slots, dtype=np.int32), np.array(lens, dtype=np.int32))
            want = base.float().clone()
            owner = np.repeat(slots, lens)
            for t in range(tokens):
                s = int(owner[t])
                if s < 0:
                    continue
                for j, piece in enumerate(layout.slices):
                    cols = slice(piece.offset, piece.offset + piece.size)
                    shrunk = a[s, j * R:(j + 1) * R].float() @ x[t].float()
                    want[t, cols] += b[s, cols].float() @ shrunk
            # Also a small-batch stretch so long that A's rows take two programs.
            variants = (("triton", TritonLoraOps()), ("torch", TorchLoraOps()),
                        ("long stretch", TritonLoraOps(LoraLaunch(1024))))
            for ops_name, ops in variants:
                delta = LoraDelta(a, b, layout, LoraContext(buffers), ops)
                got = base.clone()
                delta.add(x, got, KernelPlan(lora=True))
                got = got.float()
                scale = want.abs().max().item()
                base_rows = torch.tensor(owner < 0)
                out.append({
                    "case": name, "layer": kind, "dtype": str(dtype), "ops": ops_name,
                    "err": (got - want).abs().max().item() / scale,
                    "base_rows_same": bool(torch.equal(got[base_rows], base.float()[base_rows])),
                })
print(json.dumps(out))
"""


def test_kernels_match_a_per_row_reference_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    results = triton_interpreter(SCRIPT, CASES)
    assert len(results) == len(CASES) * 2 * 2 * 3
    for r in results:
        # float32: summation order only; 16-bit: the shrink's hand-off to the expand in 16 bits.
        bound = 1e-5 if r["dtype"] == "torch.float32" else 3e-2
        assert r["err"] <= bound, r
        assert r["base_rows_same"], r
