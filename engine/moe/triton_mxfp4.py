"""MXFP4 weights read inside the MoE kernels (W4A16): `mxfp4_values` turns packed e2m1 bytes and their
e8m0 scales into float32 weights in registers, so the experts stay 4-bit in GPU memory.

The layout the kernels read (MoEExperts' resident MXFP4 experts): every weight row packed along the
reduction, two values a byte with the lower k in the low nibble, [.., N, K / 2] uint8, and one scale
byte per 32 values of the row, [.., N, K / 32] uint8, 2^(scale - 127). That is the hub's
`*_blocks` [E, N, K / 32, 16] and `*_scales` [E, N, K / 32] as stored, so loading copies bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mxfp4_values(blocks_ptr, scales_ptr, row_bytes, row_scales, ks, mask):  # type: ignore[no-untyped-def]
    """The float32 weights at reduction index `ks` of the rows starting at byte offset `row_bytes` of
    `blocks_ptr` and scale offset `row_scales` of `scales_ptr` (all broadcast to one shape). Exact: an
    e2m1 value times a power of two. A scale byte of 0 reads as 0 (2^-127 in the format: below any
    weight that matters)."""
    packed = tl.load(blocks_ptr + row_bytes + ks // 2, mask=mask, other=0).to(tl.int32)
    code = (packed >> ((ks % 2) * 4)) & 0xF
    exponent = (code >> 1) & 0x3
    mantissa = code & 0x1
    # e2m1: exponent 0 is the subnormal 0 or 0.5; else (1 + m / 2) 2^(e - 1), built as float32 bits.
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
    value = tl.where((code & 0x8) != 0, -magnitude, magnitude)
    scale = tl.load(scales_ptr + row_scales + ks // 32, mask=mask, other=0).to(tl.int32)
    return value * (scale << 23).to(tl.float32, bitcast=True)
