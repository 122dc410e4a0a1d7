"""The batched LoRA kernels: shrink (x A^T per token, for its slot) and expand (out += s B^T), over the tiles
of `batch.py`, every slot of the batch in the same two launches.

Shrink: program (tile, split, r-block) multiplies the tile's up-to-16 token rows of x by its slot's A over
one stretch of the input (`split`), and writes float32 partial sums [splits, T, slices x R]; splitting the
input gives a one-token decode enough programs to stream A at the copy bandwidth. Expand: program (tile,
n-block, slice) sums the partials of its rows and slice, multiplies by the slot's B block and adds the
result to the layer's output in place. Tiles past the plan's count, and rows past a tile's end, do
nothing, so a grid sized by the token count alone serves every batch of that size (CUDA graphs).

Under programmatic dependent launch (pdl.py) each kernel loads what the plan or the weights give it (the
tile entries, A or B of its slot) before its `gdc_wait`, then reads the activations; nothing is written
before the wait and every program waits. The only compile-time switches are the block shapes (fixed per
layer), the one-stretch form and PDL, so serving builds a handful of kernels, not one per batch size.
Triton ships with CUDA builds of torch; imported only where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from tandem.engine.kernel_plan import KernelPlan
from tandem.engine.layers.low_rank import GemvDelta
from tandem.engine.layers.pdl import pdl_launch
from tandem.engine.lora.batch import TILE, max_tiles
from tandem.engine.lora.delta import LoraDelta

# A program's A block in the one-stretch form (`ONE_STRETCH`): BLOCK_R x BLOCK_K held in registers before the
# PDL wait, as the Triton GEMV holds its weight slice.
_SHRINK_BLOCK_K = 256
_LOOP_BLOCK_K = 128
_MAX_BLOCK_R = 64
_A_ELEMENTS = 16384  # the one-stretch shrink's A block: 32 KB of bf16, 64 registers a thread at 4 warps
_PROGRAMS = 256  # about two programs per SM of an H200 (132 SMs): the grid size the plans aim at


@triton.jit
def _tile(tiles_ptr, tile):  # type: ignore[no-untyped-def]
    """(slot, first entry, end entry) of a tile; an empty range for tiles past the plan's count."""
    count = tl.load(tiles_ptr)
    entry = tiles_ptr + 4 + 4 * tile
    slot = tl.load(entry)
    start = tl.load(entry + 1)
    end = tl.load(entry + 2)
    end = tl.where(tile < count, end, start)
    return slot, start, end


@triton.jit
def lora_shrink_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    x_ptr,
    a_ptr,
    tiles_ptr,
    tokens_ptr,
    out_ptr,
    stride_x,
    stride_a_slot,
    stride_out_split,
    stride_out_row,
    K,
    NR,
    iters,
    TILE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_STRETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    slot, start, end = _tile(tiles_ptr, tile)
    work = start < end
    rows = start + tl.arange(0, TILE)
    row_mask = rows < end
    tokens = tl.load(tokens_ptr + rows, mask=row_mask, other=0).to(tl.int64)  # the plan's: pre-graph
    x_rows = x_ptr + tokens[:, None] * stride_x
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < NR
    a_mask = r < tl.where(work, NR, 0)  # nothing of A is read for a tile with no rows
    a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + r[:, None].to(tl.int64) * K
    k0 = split * (iters * BLOCK_K)
    acc = tl.zeros((TILE, BLOCK_R), dtype=tl.float32)
    if ONE_STRETCH:
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        if PDL:  # A and the tile are constants of this graph replay: loaded under the kernel before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if work:
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(a))
    else:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if work:
            for i in range(iters):
                ks = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                a = tl.load(a_rows + ks[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                acc += tl.dot(x, tl.trans(a))
    if work:
        out = out_ptr + split * stride_out_split + tokens[:, None] * stride_out_row + r[None, :]
        tl.store(out, acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_block(s, b, y_ptr, tokens, row_mask, cols, n_mask, stride_y):  # type: ignore[no-untyped-def]
    """y[tokens, cols] += s @ b^T, in float32, rounded once."""
    delta = tl.dot(s.to(b.dtype), tl.trans(b))
    y_ptrs = y_ptr + tokens[:, None] * stride_y + cols[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


@triton.jit
def lora_expand_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    s_ptr,
    b_ptr,
    y_ptr,
    tiles_ptr,
    tokens_ptr,
    slices_ptr,
    stride_s_split,
    stride_s_row,
    stride_b_slot,
    stride_y,
    splits,
    n_steps,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    piece = tl.program_id(2)
    slot, start, end = _tile(tiles_ptr, tile)
    work = start < end
    offset = tl.load(slices_ptr + 2 * piece)
    size = tl.load(slices_ptr + 2 * piece + 1)
    rows = start + tl.arange(0, TILE)
    row_mask = rows < end
    tokens = tl.load(tokens_ptr + rows, mask=row_mask, other=0).to(tl.int64)  # the plan's: pre-graph
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < R
    b_rows = b_ptr + slot.to(tl.int64) * stride_b_slot + offset.to(tl.int64) * R + rr[None, :]
    s_rows = s_ptr + tokens[:, None] * stride_s_row + piece * R + rr[None, :]
    s_mask = row_mask[:, None] & r_mask[None, :]
    if ONE_BLOCK:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        b_mask = n < tl.where(work, size, 0)  # nothing of B is read for a tile with no rows
        b = tl.load(b_rows + n[:, None].to(tl.int64) * R, mask=b_mask[:, None] & r_mask[None, :], other=0.0)
        if PDL:  # B and the tile are constants of this graph replay: loaded under the kernel before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if work:
            s = tl.zeros((TILE, BLOCK_R), dtype=tl.float32)
            for split in range(splits):
                s += tl.load(s_rows + split * stride_s_split, mask=s_mask, other=0.0)
            _expand_block(s, b, y_ptr, tokens, row_mask, offset + n, n < size, stride_y)
    else:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if work:
            s = tl.zeros((TILE, BLOCK_R), dtype=tl.float32)  # summed once for all the program's blocks
            for split in range(splits):
                s += tl.load(s_rows + split * stride_s_split, mask=s_mask, other=0.0)
            for step in range(n_steps):
                n = (tl.program_id(1) * n_steps + step) * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = n < size
                b = tl.load(
                    b_rows + n[:, None].to(tl.int64) * R, mask=n_mask[:, None] & r_mask[None, :], other=0.0
                )
                _expand_block(s, b, y_ptr, tokens, row_mask, offset + n, n_mask, stride_y)


@dataclass(frozen=True)
class LoraLaunch:
    """The small-batch launches' choices (up to `TILE` tokens, the decode graphs that launch with PDL):
    `stretch`, the input features one shrink program holds (so the expand sums K / stretch partials),
    and `fold`, whether the expand runs inside the GEMV where the layer's GEMM is the Triton GEMV."""

    stretch: int = _SHRINK_BLOCK_K
    fold: bool = True  # hand the shrink's partials to the Triton GEMV's epilogue where the layer runs one

    def block_r(self, nr: int) -> int:
        """The shrink's rows of A a program: all of a slot's (up to 64) while its A block stays within
        `_A_ELEMENTS`, fewer for longer stretches."""
        return min(
            _MAX_BLOCK_R, max(16, int(triton.next_power_of_2(nr))), max(16, _A_ELEMENTS // self.stretch)
        )


def shrink_plan(tokens: int, k: int, slots: int, stretch: int = _SHRINK_BLOCK_K) -> tuple[int, int, int]:
    """(splits, BLOCK_K, iterations) for a shrink of `tokens` rows over an input of `k` features. Up to 16
    tokens (decode graphs whose kernels launch with PDL) one `stretch` of the input per program, held
    before the wait. More tokens loop over 128-wide blocks, the input split so the grid is about two
    programs an SM (a power of two, fewer the more tiles there are, so the partial sums stay small).
    Splits and iterations are runtime arguments: no batch size builds a kernel of its own."""
    if tokens <= TILE:
        return triton.cdiv(k, stretch), stretch, 1
    tiles = max_tiles(tokens, slots)
    splits = max(1, min(triton.cdiv(k, _SHRINK_BLOCK_K), _PROGRAMS // tiles))
    splits = 1 << (splits.bit_length() - 1)
    return splits, _LOOP_BLOCK_K, triton.cdiv(triton.cdiv(k, splits), _LOOP_BLOCK_K)


def expand_plan(tokens: int, slots: int, widest: int, slices: int) -> tuple[int, int, int]:
    """(BLOCK_N, blocks per program, program groups per slice) for an expand: up to 16 tokens one block a
    program, B held before the PDL wait; more tokens loop over blocks, so each program sums its rows'
    partials once for all of them, with about four programs an SM over the grid."""
    if tokens <= TILE:
        return 64, 1, triton.cdiv(widest, 64)
    block_n = 64 if tokens <= 256 else 128
    blocks = triton.cdiv(widest, block_n)
    groups = max(1, min(blocks, 4 * _PROGRAMS // (max_tiles(tokens, slots) * slices)))
    steps = triton.cdiv(blocks, groups)
    return block_n, steps, triton.cdiv(blocks, steps)


class TritonLoraOps:
    """The two launches of a layer's delta on CUDA, or the shrink alone with the expand folded into the
    layer's GEMV."""

    def __init__(self, launch: LoraLaunch | None = None) -> None:
        self.launch = launch or LoraLaunch()

    def add(self, x: torch.Tensor, out: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> None:
        if x.stride(1) != 1:
            x = x.contiguous()
        self.expand(self.shrink(x, delta, plan), out, delta, plan)

    def fold(self, x: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> GemvDelta | None:
        if not self.launch.fold or x.shape[0] > TILE:
            return None
        partial = self.shrink(x, delta, plan)
        return GemvDelta(partial, delta.b, delta.batch.token_slots, delta.slices, delta.rank)

    def shrink(self, x: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> torch.Tensor:
        """The float32 partial sums [splits, tokens, slices x R] of x A^T for each token's slot."""
        tokens, k = x.shape
        a, batch = delta.a, delta.batch
        slots, nr = a.shape[0], a.shape[1]
        small = tokens <= TILE
        splits, block_k, iters = shrink_plan(tokens, k, slots, self.launch.stretch)
        block_r = (
            self.launch.block_r(nr) if small else min(_MAX_BLOCK_R, max(16, int(triton.next_power_of_2(nr))))
        )
        partial = torch.empty(splits, tokens, nr, dtype=torch.float32, device=x.device)
        shrink: Any = lora_shrink_kernel[(max_tiles(tokens, slots), splits, triton.cdiv(nr, block_r))]
        shrink(
            x,
            a,
            batch.tiles,
            batch.sorted_tokens,
            partial,
            x.stride(0),
            a.stride(0),
            partial.stride(0),
            partial.stride(1),
            k,
            nr,
            iters,
            TILE=TILE,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            ONE_STRETCH=small,
            num_warps=4,
            **pdl_launch(plan.pdl or plan.lora_pdl),
        )
        return partial

    def expand(self, partial: torch.Tensor, out: torch.Tensor, delta: LoraDelta, plan: KernelPlan) -> None:
        """out += the partials' sum times each token's slot's B, scaled (B holds the scale)."""
        splits, tokens = partial.shape[0], partial.shape[1]
        b, batch = delta.b, delta.batch
        slots = delta.a.shape[0]
        small = tokens <= TILE
        r = delta.rank
        pieces = len(delta.layout.slices)
        block_n, steps, groups = expand_plan(tokens, slots, delta.max_slice, pieces)
        expand: Any = lora_expand_kernel[(max_tiles(tokens, slots), groups, pieces)]
        expand(
            partial,
            b,
            out,
            batch.tiles,
            batch.sorted_tokens,
            delta.slices,
            partial.stride(0),
            partial.stride(1),
            b.stride(0),
            out.stride(0),
            splits,
            steps,
            R=r,
            BLOCK_R=max(16, int(triton.next_power_of_2(r))),
            TILE=TILE,
            BLOCK_N=block_n,
            ONE_BLOCK=small,
            num_warps=4,
            **pdl_launch(plan.pdl or plan.lora_pdl),
        )
