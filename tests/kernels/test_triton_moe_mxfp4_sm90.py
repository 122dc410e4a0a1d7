"""The fused MoE kernels compile for Hopper (sm_90) with no GPU here: Triton's own compiler and the ptxas
its wheel ships, from the kernels' source to a cubin. What the interpreter cannot vouch for: that the
MXFP4 path's reshapes, splits and two-halves tl.dot lower (a tuple of shapes held in a variable, which
the interpreter takes, does not), and that its weights are read as byte tiles: the grouped GEMM's in
16-byte asynchronous copies, the GEMVs' without one load a byte (before the byte tiles the GEMM issued
256 single-byte loads a thread a K step, the down GEMV 1,024). The dense and FP8 options compile too.
gpt-oss-20b's shape (hidden and intermediate 2880), bf16 activations. Skips without Triton (CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.engine.moe.triton_gemm import grouped_gemm_kernel
from tandem.engine.moe.triton_small import down_kernel, up_kernel


def build(fn, types, consts, warps, stages):
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    # What the launcher tells the compiler of 16-aligned pointers and strides (the engine's tensors).
    aligned = [n for n, t in types.items() if t.startswith("*") or n.startswith("stride") or n in ("N", "K")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    copies = r"async_copy_global_to_local[^\\n]*contiguity = 16[^\\n]*x!tt.ptr<i8>"
    return {"cubin": len(kernel.asm["cubin"]), "byte_loads": len(re.findall(r"ld\\.global\\.[bu]8", ptx)),
            "tile_copies": len(re.findall(copies, ttgir))}


def gemm(fmt, gated, bm, bn, bk, stages):
    w = {"mxfp4": "*u8", "fp8": "*fp8e4nv", "dense": "*bf16"}[fmt]
    types = dict(a_ptr="*bf16", w_ptr=w, out_ptr="*bf16", sorted_ptr="*i32", block_experts_ptr="*i32",
                 total_ptr="*i32", weights_ptr="*fp32", num_pairs="i32", max_row_blocks="i32", N="i32",
                 K="i32", stride_a="i32", stride_we="i32", stride_wn="i32", stride_out="i32",
                 bias_ptr="*bf16", stride_bias="i32", alpha="fp32", limit="fp32", stride_se="i32",
                 stride_sn="i32", scales_ptr="*u8" if fmt == "mxfp4" else "*fp32")
    consts = dict(A_ROW_DIV=4 if gated else 1, GATED=gated, WEIGHTED=not gated, BM=bm, BN=bn, BK=bk,
                  GROUP_M=1, HAS_BIAS=True, CLAMPED=gated, MXFP4=fmt == "mxfp4", FP8=fmt == "fp8",
                  SB_N=128, SB_K=128)
    return build(grouped_gemm_kernel, types, consts, 4, stages)


def small(kind, fmt, bn, bk):
    consts = dict(E=32, E_PAD=32, TOPK=4, K_PAD=4, RENORM=False, HIDDEN=2880, INTER=2880, BN=bn, BK=bk,
                  ROUTED=True, PDL=True, HAS_BIAS=True, TOPK_SOFTMAX=True, MXFP4=fmt == "mxfp4", FP8=False,
                  SB_N=128, SB_K=128)
    w = "*u8" if fmt == "mxfp4" else "*bf16"
    if kind == "up":
        types = dict(x_ptr="*bf16", logits_ptr="*bf16", ids_ptr="*i32", w13_ptr=w, act_ptr="*bf16",
                     stride_x="i32", stride_logits="i32", stride_we="i32", expert_start="i32",
                     num_local="i32", b13_ptr="*bf16", stride_b13="i32", alpha="fp32", limit="fp32",
                     s13_ptr="*u8", stride_se="i32")
        return build(up_kernel, types, {**consts, "CLAMPED": True}, 4, 1)
    types = dict(act_ptr="*bf16", logits_ptr="*bf16", ids_ptr="*i32", weights_ptr="*fp32", w2_ptr=w,
                 out_ptr="*bf16", shared_ptr="*bf16", shared_gate_ptr="*bf16", stride_logits="i32",
                 stride_we="i32", stride_out="i32", stride_shared="i32", stride_gate="i32",
                 expert_start="i32", num_local="i32", b2_ptr="*bf16", stride_b2="i32", s2_ptr="*u8",
                 stride_se="i32")
    return build(down_kernel, types, {**consts, "SHARED": False}, 4, 1)


# The engine's tiles (tiles.py: decode and prefill GEMM blocks, the small path's BN and BK at 2880) and the
# smallest MXFP4 K step.
out = {
    "gemm_mxfp4_up": gemm("mxfp4", True, 16, 64, 128, 3),
    "gemm_mxfp4_down": gemm("mxfp4", False, 16, 64, 128, 4),
    "gemm_mxfp4_up_prefill": gemm("mxfp4", True, 64, 64, 64, 3),
    "gemm_mxfp4_bk32": gemm("mxfp4", True, 16, 32, 32, 2),
    "gemm_dense_up": gemm("dense", True, 16, 64, 128, 3),
    "gemm_fp8_up": gemm("fp8", True, 16, 64, 128, 3),
    "up_mxfp4": small("up", "mxfp4", 1, 1024),
    "down_mxfp4": small("down", "mxfp4", 4, 2048),
    "up_dense": small("up", "dense", 1, 1024),
    "down_dense": small("down", "dense", 4, 2048),
}
print(json.dumps(out))
"""


def test_the_moe_kernels_compile_for_sm90_and_read_mxfp4_weights_as_byte_tiles() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(r["cubin"] > 0 for r in out.values()), out
    for name in ("gemm_mxfp4_up", "gemm_mxfp4_down", "gemm_mxfp4_up_prefill"):
        # The engine's tiles: the packed tile (the gate's and the up's where gated) in 16-byte copies.
        # (At BK 32 a K step's tile is 4 bytes a thread: copies of 4.)
        assert out[name]["tile_copies"] >= 1, (name, out[name])
    for name in ("gemm_mxfp4_up", "gemm_mxfp4_down", "gemm_mxfp4_up_prefill", "gemm_mxfp4_bk32", "up_mxfp4",
                 "down_mxfp4"):  # fmt: skip
        # Single-byte loads only for the small scale tiles ([BK / 32] bytes a row).
        assert out[name]["byte_loads"] <= 8, (name, out[name])
