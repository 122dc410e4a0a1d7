"""The fused MoE path on CUDA: which Triton kernels run for a batch, their block sizes, and their buffers.

Everything is decided from shapes (the token count is a shape, fixed for each captured graph), and no
value is read back to the host: routing, grouping by expert and both GEMMs run on the device with buffers
of their worst-case size, so the layer captures into decode and piecewise CUDA graphs like the dense
MLP. One or two tokens take triton_small.py (three launches); more take triton_route.py's routing and
grouping and triton_gemm.py's grouped GEMMs and top-k sum.

flashinfer 0.7's fused MoE is not used: its bf16 path on Hopper is a CUTLASS module compiled at first use
from sources our GPU bundle strips (it keeps attention, norm, rope and sampling), and its trtllm-gen
kernels need Blackwell.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import triton

from tandem.engine.layers.pdl import pdl_launch
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.moe.tiles import SMALL_BLOCKS, GemmBlocks, SmallBlocks, gemm_blocks, reduction_block
from tandem.engine.moe.triton_gemm import grouped_gemm_kernel, sum_kernel
from tandem.engine.moe.triton_route import align_kernel, route_kernel
from tandem.engine.moe.triton_small import choose_kernel, down_kernel, up_kernel
from tandem.engine.quant.fp8_format import fp8_block_fits

# Up to this many tokens the experts run as per-pair GEMVs (triton_small.py): their few pairs rarely share
# an expert, so grouping saves no weight reads and costs two more launches.
SMALL_MAX_TOKENS = 2
ONEHOT_ELEMENTS = 8192  # route_kernel's [BT * k, experts] one-hot per program


@dataclass
class Routing:
    """The grouped path's schedule for one batch: every pair's expert and weight, and the pairs laid out
    by expert in blocks of `up.bm` rows (the padding slots hold the sentinel `num_pairs`)."""

    ids: torch.Tensor  # int32 [T, k], global expert ids
    weights: torch.Tensor  # float32 [T, k]
    sorted_pairs: torch.Tensor  # int32 [max_slots]
    block_experts: torch.Tensor  # int32 [max_row_blocks]
    total: torch.Tensor  # int32 [1]: the padded slots in use
    num_pairs: int
    max_row_blocks: int
    up: GemmBlocks
    down: GemmBlocks


Biases = tuple[torch.Tensor | None, torch.Tensor | None]  # (b13, b2) of the experts, or None each
Scales = tuple[torch.Tensor | None, torch.Tensor | None]  # MXFP4 or FP8 experts' (s13, s2), or None each
Block = tuple[int, int] | None  # FP8 experts' scale block (rows, columns)


def weight_options(
    w: torch.Tensor, scale: torch.Tensor | None, fp8_block: Block = None, reduction: int | None = None
) -> dict[str, Any]:
    """A launch's weight-format arguments: MXFP4 with the e8m0 scales of packed uint8 `w`, FP8 with the
    float32 `fp8_block` scales of float8_e4m3fn `w`, or the dense default (`w` a placeholder for the
    scales pointer the launch does not read). MXFP4: `w`'s rows hold `reduction` values (the launch's
    K), a multiple of 32, as the kernels read them (whole 32-value blocks a K step)."""
    dense = {"MXFP4": False, "FP8": False, "SB_N": 128, "SB_K": 128}
    if scale is None:
        return dense | {"scales": w, "stride_e": 0, "stride_n": 0}
    strides = {"scales": scale, "stride_e": scale.stride(0), "stride_n": scale.stride(1)}
    if w.dtype == torch.float8_e4m3fn:
        fits = fp8_block is not None and fp8_block_fits(fp8_block)
        if not fits or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"FP8 experts: weight {list(w.shape)}, scales {scale.dtype} "
                             f"{list(scale.shape)}, block {fp8_block}")  # fmt: skip
        assert fp8_block is not None
        return dense | strides | {"FP8": True, "SB_N": fp8_block[0], "SB_K": fp8_block[1]}
    k = w.shape[-1] * 2
    if w.dtype != torch.uint8 or scale.dtype != torch.uint8 or k != scale.shape[-1] * 32:
        raise ValueError(f"MXFP4 experts: blocks {w.dtype} {list(w.shape)} and scales {list(scale.shape)}")
    if reduction is not None and reduction != k:
        raise ValueError(f"MXFP4 experts: blocks {list(w.shape)} hold rows of {k} values, the layer's are "
                         f"{reduction} (a multiple of 32)")  # fmt: skip
    return dense | strides | {"MXFP4": True}


class FusedMoE:
    """The routed experts of one layer on CUDA: `__call__(x, logits, w13, w2, shared, shared_gate)`.

    The kernels route by softmax top-k, or top-k then softmax (gpt-oss), themselves. `choice` (weights
    float32 [T, k], expert ids [T, k]): a choice made already, by a router the kernels do not implement
    (DeepSeek's grouped scorings, routing.py `route`, in torch without a host sync): the kernels then
    skip their own routing and group the given pairs."""

    def __init__(self, spec: MoESpec, shard: ExpertShard, hidden_size: int) -> None:
        self.spec, self.shard, self.hidden = spec, shard, hidden_size
        self.experts_pad = triton.next_power_of_2(spec.num_experts)
        self.k_pad = triton.next_power_of_2(spec.top_k)
        self.local_pad = triton.next_power_of_2(shard.num_local)
        self.route_block = max(1, min(64, ONEHOT_ELEMENTS // (self.k_pad * self.local_pad)))
        # gpt-oss's options (MoESpec): top-k-then-softmax routing, biases, the clamped SwiGLU.
        self.topk_softmax = spec.scoring == "topk_softmax"

    def __call__(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        pdl: bool = False,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        s13: torch.Tensor | None = None,
        s2: torch.Tensor | None = None,
        choice: tuple[torch.Tensor, torch.Tensor] | None = None,
        fp8_block: Block = None,
    ) -> torch.Tensor:
        """`b13` [E_local, 2I] and `b2` [E_local, H]: the experts' biases, where the spec has them.
        `s13` and `s2`: MXFP4 experts' e8m0 scales, [E_local, 2I, H / 32] and [E_local, H, I / 32]; with
        them `w13` [E_local, 2I, H / 2] and `w2` [E_local, H, I / 2] are their packed uint8 blocks
        (triton_mxfp4.py), which the kernels unpack as they read. Or FP8 experts' float32 scales per
        `fp8_block` (triton_fp8.py): `w13` [E_local, 2I, H] and `w2` [E_local, H, I] float8_e4m3fn,
        `s13` [E_local, 2 ceil(I / b0), ceil(H / b1)] (the gate's block rows, then the up's) and `s2`
        [E_local, ceil(H / b0), ceil(I / b1)]."""
        biases, scales = (b13, b2), (s13, s2)
        if x.shape[0] <= SMALL_MAX_TOKENS:
            return self._small(x, logits, w13, w2, shared, shared_gate, pdl, biases=biases, scales=scales,
                               choice=choice, fp8_block=fp8_block)  # fmt: skip
        routing = self.route(logits, choice=choice)
        pairs = self.expert_gemms(x, routing, w13, w2, biases, scales, fp8_block)
        return self.sum(pairs, routing, shared, shared_gate)

    def _options(self, w: torch.Tensor, biases: Biases, *, up: bool) -> dict[str, Any]:
        """The gpt-oss options of an up (gate/up) or down launch: its bias (the down bias only on the rank
        that adds it, so it counts once per token after the all-reduce) and the clamped SwiGLU. `w` is a
        placeholder for a bias the launch does not read."""
        s = self.spec
        bias = biases[0] if up else (biases[1] if self.shard.inter_start == 0 else None)
        options: dict[str, Any] = {"HAS_BIAS": bias is not None}
        if up:
            options |= {"alpha": s.swiglu_alpha, "limit": s.swiglu_limit}
            options["CLAMPED"] = s.activation == "swiglu_clamped"
        return options | {
            "bias": w if bias is None else bias,
            "stride": 0 if bias is None else bias.stride(0),
        }

    def _small(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        shared: torch.Tensor | None,
        shared_gate: torch.Tensor | None,
        pdl: bool = False,
        blocks: SmallBlocks | None = None,
        biases: Biases = (None, None),
        scales: Scales = (None, None),
        choice: tuple[torch.Tensor, torch.Tensor] | None = None,
        fp8_block: Block = None,
    ) -> torch.Tensor:
        tokens, k, inter, hidden = x.shape[0], self.spec.top_k, self.shard.inter_size, self.hidden
        b = blocks or SMALL_BLOCKS
        if choice is not None:  # the up and down programs read the given choice
            b = dataclasses.replace(b, routed=True)
        act = torch.empty(tokens * k, inter, dtype=x.dtype, device=x.device)
        route = self._route_args()
        ids = torch.empty(tokens, k, dtype=torch.int32, device=x.device)
        weights = torch.empty(tokens, k, dtype=torch.float32, device=x.device)
        if choice is not None:
            weights.copy_(choice[0]), ids.copy_(choice[1])
        elif b.routed:
            s = self.spec
            choose: Any = choose_kernel[(tokens,)]
            choose(logits, ids, weights, logits.stride(0), E=s.num_experts, E_PAD=self.experts_pad, TOPK=k,
                   K_PAD=self.k_pad, RENORM=s.renormalize, TOPK_SOFTMAX=self.topk_softmax, num_warps=1,
                   **pdl_launch(pdl))  # fmt: skip
        o = self._options(w13, biases, up=True)
        f = weight_options(w13, scales[0], fp8_block, hidden)
        # FP8 and MXFP4: a reduction step holds whole scale blocks.
        up_k, up_n = max(reduction_block(b.up_bk, hidden), f["FP8"] * f["SB_K"], f["MXFP4"] * 32), b.up_bn
        up: Any = up_kernel[(tokens * k, triton.cdiv(inter, up_n))]
        up(x, logits, ids, w13, act, x.stride(0), logits.stride(0), w13.stride(0), *route,
           HIDDEN=hidden, INTER=inter, BN=up_n, BK=up_k, ROUTED=b.routed, num_warps=b.up_warps,
           b13_ptr=o["bias"], stride_b13=o["stride"], alpha=o["alpha"], limit=o["limit"],
           HAS_BIAS=o["HAS_BIAS"], CLAMPED=o["CLAMPED"], TOPK_SOFTMAX=self.topk_softmax,
           s13_ptr=f["scales"], stride_se=f["stride_e"], MXFP4=f["MXFP4"], FP8=f["FP8"], SB_N=f["SB_N"],
           SB_K=f["SB_K"], **pdl_launch(pdl))  # fmt: skip
        d = self._options(w2, biases, up=False)
        f = weight_options(w2, scales[1], fp8_block, inter)
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        has_shared = shared is not None and shared_gate is not None
        down_k = max(reduction_block(b.down_bk, inter), f["FP8"] * f["SB_K"], f["MXFP4"] * 32)
        down_n = b.down_bn
        down: Any = down_kernel[(tokens, triton.cdiv(hidden, down_n))]
        down(
            act,
            logits,
            ids,
            weights,
            w2,
            out,
            shared if has_shared else out,  # placeholders without a shared expert: never read
            shared_gate if has_shared else out,
            logits.stride(0),
            w2.stride(0),
            out.stride(0),
            shared.stride(0) if shared is not None and has_shared else 0,
            shared_gate.stride(0) if shared_gate is not None and has_shared else 0,
            *route,
            HIDDEN=hidden,
            INTER=inter,
            BN=down_n,
            BK=down_k,
            SHARED=has_shared,
            ROUTED=b.routed,
            num_warps=b.down_warps,
            b2_ptr=d["bias"],
            stride_b2=d["stride"],
            HAS_BIAS=d["HAS_BIAS"],
            TOPK_SOFTMAX=self.topk_softmax,
            s2_ptr=f["scales"],
            stride_se=f["stride_e"],
            MXFP4=f["MXFP4"],
            FP8=f["FP8"],
            SB_N=f["SB_N"],
            SB_K=f["SB_K"],
            **pdl_launch(pdl),
        )
        return out

    def _route_args(self) -> tuple[Any, ...]:
        """expert_start, num_local, then the routing constexprs E, E_PAD, TOPK, K_PAD, RENORM."""
        s = self.spec
        return (
            self.shard.expert_start,
            self.shard.num_local,
            s.num_experts,
            self.experts_pad,
            s.top_k,
            self.k_pad,
            s.renormalize,
        )

    def route(
        self,
        logits: torch.Tensor,
        tiles: tuple[GemmBlocks, GemmBlocks] | None = None,
        choice: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Routing:
        """Top-k and the grouping by expert for router `logits` [T, E] (two launches), for the GEMMs'
        (up, down) `tiles` (by default `gemm_blocks`'; both must share their BM, the schedule's); with
        `choice`, the grouping of those pairs."""
        tokens, k, device = logits.shape[0], self.spec.top_k, logits.device
        num_pairs, local = tokens * k, self.shard.num_local
        per_expert = num_pairs / self.spec.num_experts
        up, down = tiles or (gemm_blocks(per_expert, gated=True), gemm_blocks(per_expert, gated=False))
        if up.bm != down.bm:
            raise ValueError(f"the up and down GEMMs share one schedule: BM {up.bm} != {down.bm}")
        bm = up.bm
        blocks = triton.cdiv(tokens, self.route_block)
        ids = torch.empty(tokens, k, dtype=torch.int32, device=device)
        weights = torch.empty(tokens, k, dtype=torch.float32, device=device)
        counts = torch.empty(blocks, local, dtype=torch.int32, device=device)
        ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
        if choice is not None:
            weights.copy_(choice[0]), ids.copy_(choice[1])
        s = self.spec
        route: Any = route_kernel[(blocks,)]
        route(logits, ids, weights, counts, ranks, tokens, logits.stride(0), self.shard.expert_start, local,
              E=s.num_experts, E_PAD=self.experts_pad, TOPK=k, K_PAD=self.k_pad, RENORM=s.renormalize,
              BT=self.route_block, LOCAL_PAD=self.local_pad, TOPK_SOFTMAX=self.topk_softmax,
              GIVEN=choice is not None,
              num_warps=4)  # fmt: skip
        max_slots = num_pairs + local * (bm - 1)
        max_row_blocks = triton.cdiv(max_slots, bm)
        sorted_pairs = torch.empty(max_row_blocks * bm, dtype=torch.int32, device=device)
        block_experts = torch.empty(max_row_blocks, dtype=torch.int32, device=device)
        total = torch.empty(1, dtype=torch.int32, device=device)
        align: Any = align_kernel[(1,)]
        align(ids, counts, ranks, sorted_pairs, block_experts, total, num_pairs, blocks, max_row_blocks,
              self.shard.expert_start, local, TOPK=k, BT=self.route_block, BM=bm,
              LOCAL_PAD=self.local_pad, CHUNK=max(1, ONEHOT_ELEMENTS // self.local_pad), PAIR_CHUNK=1024,
              num_warps=8)  # fmt: skip
        return Routing(ids, weights, sorted_pairs, block_experts, total, num_pairs, max_row_blocks, up, down)

    def expert_gemms(
        self,
        x: torch.Tensor,
        routing: Routing,
        w13: torch.Tensor,
        w2: torch.Tensor,
        biases: Biases = (None, None),
        scales: Scales = (None, None),
        fp8_block: Block = None,
    ) -> torch.Tensor:
        """Both grouped GEMMs: the weighted down projection of every pair, [T * k, H] (rows of other
        ranks' experts are left unwritten)."""
        inter, k, hidden = self.shard.inter_size, self.spec.top_k, self.hidden
        act = torch.empty(routing.num_pairs, inter, dtype=x.dtype, device=x.device)
        up = self._options(w13, biases, up=True) | weight_options(w13, scales[0], fp8_block, hidden)
        self._gemm(x, w13, act, routing, routing.up, n=inter, k_dim=hidden, row_div=k, gated=True, options=up)
        pairs = torch.empty(routing.num_pairs, hidden, dtype=x.dtype, device=x.device)
        down = self._options(w2, biases, up=False) | weight_options(w2, scales[1], fp8_block, inter)
        self._gemm(act, w2, pairs, routing, routing.down, n=hidden, k_dim=inter, row_div=1, gated=False,
                   options=down)  # fmt: skip
        return pairs

    def _gemm(
        self,
        a: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor,
        routing: Routing,
        blocks: GemmBlocks,
        *,
        n: int,
        k_dim: int,
        row_div: int,
        gated: bool,
        options: dict[str, Any],
    ) -> None:
        grid = (routing.max_row_blocks * triton.cdiv(n, blocks.bn),)
        gemm: Any = grouped_gemm_kernel[grid]
        o = options
        # FP8: a K step within one scale block (both powers of two), so it has one scale a column.
        # MXFP4: whole 32-value blocks, and each half of a step (its even and odd k) a tl.dot of K >= 16.
        bk = min(blocks.bk, o["SB_K"]) if o.get("FP8") else blocks.bk
        bk = max(bk, 32) if o.get("MXFP4") else bk
        gemm(a, w, out, routing.sorted_pairs, routing.block_experts, routing.total, routing.weights,
             routing.num_pairs, routing.max_row_blocks, n, k_dim, a.stride(0), w.stride(0), w.stride(1),
             out.stride(0), A_ROW_DIV=row_div, GATED=gated, WEIGHTED=not gated, BM=blocks.bm, BN=blocks.bn,
             BK=bk, GROUP_M=blocks.group_m, num_warps=blocks.num_warps,
             num_stages=blocks.num_stages, bias_ptr=o["bias"], stride_bias=o["stride"],
             alpha=o.get("alpha", 1.0), limit=o.get("limit", 0.0), HAS_BIAS=o["HAS_BIAS"],
             CLAMPED=o.get("CLAMPED", False), scales_ptr=o.get("scales", w),
             stride_se=o.get("stride_e", 0), stride_sn=o.get("stride_n", 0),
             MXFP4=o.get("MXFP4", False), FP8=o.get("FP8", False), SB_N=o.get("SB_N", 128),
             SB_K=o.get("SB_K", 128))  # fmt: skip

    def sum(
        self,
        pairs: torch.Tensor,
        routing: Routing,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each token's k weighted rows added (+ sigmoid(gate) * shared): [T, H]."""
        tokens, hidden = routing.ids.shape[0], self.hidden
        out = torch.empty(tokens, hidden, dtype=pairs.dtype, device=pairs.device)
        has_shared = shared is not None and shared_gate is not None
        block = min(1024, triton.next_power_of_2(hidden))
        add: Any = sum_kernel[(tokens, triton.cdiv(hidden, block))]
        add(pairs, routing.ids, out, shared if has_shared else out, shared_gate if has_shared else out,
            hidden, pairs.stride(0), out.stride(0),
            shared.stride(0) if shared is not None and has_shared else 0,
            shared_gate.stride(0) if shared_gate is not None and has_shared else 0,
            self.shard.expert_start, self.shard.num_local, TOPK=self.spec.top_k, K_PAD=self.k_pad, BH=block,
            SHARED=has_shared, num_warps=4)  # fmt: skip
        return out
