"""The fused MoE kernels' tiles: the small path's launch shapes and the grouped GEMMs' blocks, each a
function of shapes alone (fused.py picks them per batch, so captured graphs keep theirs)."""

from __future__ import annotations

from dataclasses import dataclass

import triton


def reduction_block(wanted: int, reduction: int) -> int:
    """A small-path kernel's BK: `wanted` (0 for 2,048), but no more than the reduction's power of two;
    the kernels unroll their reduction, so one block covers it up to that size."""
    return min(wanted or 2048, int(triton.next_power_of_2(reduction)))


@dataclass(frozen=True)
class SmallBlocks:
    """The one- and two-token path's launches: whether one program a token routes first (`routed`:
    choose_kernel, then each up and down program reads its experts) or every program routes for itself;
    each kernel's output features a program (BN), largest reduction block (BK, 0 for 2,048) and
    warps. The defaults are the fastest of benchmarks/kernels/moe_small_variants.py's sweep at one token
    and within 1% of it at two (benchmarks/results/moe-small-variants-h200.json)."""

    routed: bool = True
    up_bn: int = 1
    up_bk: int = 1024
    up_warps: int = 4
    down_bn: int = 4
    down_bk: int = 0
    down_warps: int = 4


SMALL_BLOCKS = SmallBlocks()


@dataclass(frozen=True)
class GemmBlocks:
    """One grouped GEMM's tile: BM rows (all of one expert), BN outputs, BK of the reduction."""

    bm: int
    bn: int
    bk: int
    group_m: int
    num_warps: int
    num_stages: int


def gemm_blocks(rows_per_expert: float, *, gated: bool) -> GemmBlocks:
    """The tile for a batch whose experts see `rows_per_expert` pairs on average. Few rows (decode): the
    GEMMs stream the weights, and a block of rows large enough that an expert's pairs rarely spill into
    a second block (which would read its weights again) with long K steps; many rows (prefill): 64-row
    blocks that reuse each weight tile over more rows. The gated up GEMM holds two accumulators and two
    weight tiles, so it always takes one pipeline stage less, and at 64 rows half the columns."""
    stages = 3 if gated else 4
    if rows_per_expert <= 8:
        return GemmBlocks(16, 64, 128, 1, 4, stages)
    if rows_per_expert <= 24:
        return GemmBlocks(32, 64, 128, 1, 4, stages)
    return GemmBlocks(64, 64 if gated else 128, 64, 8, 4 if gated else 8, 3)
