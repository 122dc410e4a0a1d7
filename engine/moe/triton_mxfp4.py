"""MXFP4 weights read inside the MoE kernels (W4A16): `mxfp4_unpack` turns a tile of packed e2m1 bytes
and its e8m0 scales into float32 weights in registers, so the experts stay 4-bit in GPU memory.

The layout the kernels read (MoEExperts' resident MXFP4 experts): every weight row packed along the
reduction, two values a byte with the lower k in the low nibble, [.., N, K / 2] uint8, and one scale
byte per 32 values of the row, [.., N, K / 32] uint8, 2^(scale - 127). That is the hub's
`*_blocks` [E, N, K / 32, 16] and `*_scales` [E, N, K / 32] as stored, so loading copies bytes.

How the kernels read it: a K step of BK values loads the rows' BK / 2 bytes as one tile with plain
contiguous offsets (each byte once, in vector loads) and their BK / 32 scales as another; `mxfp4_unpack`
splits each byte into its two values, the even k (low nibble) and the odd k (high nibble), as two tiles
of the byte tile's shape, and multiplies each by its block's scale. The kernels pair them with the
activations' even and odd elements (the activations loaded contiguously, then split in two), so the
weights are never interleaved back: the GEMVs (triton_small.py) sum both products, the grouped GEMM
(triton_gemm.py) runs one tl.dot for each half. K steps cover whole 32-value blocks (BK a multiple of 32,
the reduction length a multiple of 32: fused.weight_options checks it).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_float(bits):  # type: ignore[no-untyped-def]
    """2^-14 times the e2m1 values of `bits` (int32, the code's sign at bit 15 and its exponent and
    mantissa at bits 9-11, the rest 0), exact, as float32. Those are the bits of a float16 whose
    exponent and mantissa are the code's own: e2m1's subnormal 0.5 lands on a float16 subnormal, which
    the conversion to float32 keeps (float32 subnormals, which a GPU may flush, never occur)."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def mxfp4_unpack(packed, scales, K_AXIS: tl.constexpr):  # type: ignore[no-untyped-def]
    """(even, odd): the float32 weights of a tile of packed bytes, each tile of `packed`'s shape, the
    values at even reduction indices (low nibbles) and at odd ones (high nibbles), each times its
    block's scale. Along axis K_AXIS `packed` holds whole 32-value blocks (16 bytes each) and `scales`
    one byte a block: [R, B / 2] and [R, B / 32] with K_AXIS 1, [B / 2, R] and [B / 32, R] with K_AXIS
    0 (B values a row). Exact for scales up to 2^113 (e8m0 byte 240; a larger one would read as inf: no
    trained weight comes near it). A scale byte of 0 reads as 0 (2^-127 in the format: below any weight
    that matters); masked-off bytes and scales loaded as 0 read as 0."""
    byte = packed.to(tl.int32)
    even = e2m1_float(((byte & 0x8) << 12) | ((byte & 0x7) << 9))
    odd = e2m1_float(((byte & 0x80) << 8) | ((byte & 0x70) << 5))
    # 2^(scale - 127) built as float32 bits, once a block, times the 2^14 that e2m1_float leaves out.
    factor = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0
    # The shapes written out in the calls: a tuple assigned to a variable would hold tensors, not
    # constexprs, when compiled.
    if K_AXIS == 1:
        even = tl.reshape(even, (packed.shape[0], scales.shape[1], 16)) * factor[:, :, None]
        odd = tl.reshape(odd, (packed.shape[0], scales.shape[1], 16)) * factor[:, :, None]
    else:
        even = tl.reshape(even, (scales.shape[0], 16, packed.shape[1])) * factor[:, None, :]
        odd = tl.reshape(odd, (scales.shape[0], 16, packed.shape[1])) * factor[:, None, :]
    return tl.reshape(even, packed.shape), tl.reshape(odd, packed.shape)


@triton.jit
def mxfp4_tile(  # type: ignore[no-untyped-def]  # pointers and constexprs
    blocks_ptr,
    scales_ptr,
    row_bytes,
    row_scales,
    row_mask,
    k0,
    left,
    BK: tl.constexpr,
    K_AXIS: tl.constexpr,
):
    """(even, odd): `mxfp4_unpack` of the weights at reduction indices [k0, k0 + BK) of some rows, read
    as one tile of BK / 2 bytes a row and one of BK / 32 scales a row. `row_bytes` and `row_scales`: the
    rows' first byte in `blocks_ptr` and first scale in `scales_ptr`, and `row_mask` the rows that
    exist, all [R, 1] with K_AXIS 1 (tiles [R, BK / 2]) or [1, R] with K_AXIS 0 (tiles [BK / 2, R]).
    `left`: the indices from k0 on that exist (the rest read as 0). k0 and `left` are multiples of 32;
    where the compiler cannot see that of a runtime `left`, the caller says so (tl.multiple_of), so a
    thread's bytes under the mask stay one vector load."""
    kb = tl.arange(0, BK // 2)
    kg = tl.arange(0, BK // 32)
    if K_AXIS == 1:
        byte_at, byte_mask = kb[None, :], row_mask & (kb < left // 2)[None, :]
        scale_at, scale_mask = kg[None, :], row_mask & (kg < left // 32)[None, :]
    else:
        byte_at, byte_mask = kb[:, None], row_mask & (kb < left // 2)[:, None]
        scale_at, scale_mask = kg[:, None], row_mask & (kg < left // 32)[:, None]
    packed = tl.load(blocks_ptr + row_bytes + k0 // 2 + byte_at, mask=byte_mask, other=0)
    scales = tl.load(scales_ptr + row_scales + k0 // 32 + scale_at, mask=scale_mask, other=0)
    return mxfp4_unpack(packed, scales, K_AXIS)
