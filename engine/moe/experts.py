"""One layer's routed experts, stacked into the layout the kernels read, and loaded from either
checkpoint layout.

`w13` [E_local, 2 I_local, H] holds each expert's gate rows, then its up rows; `w2` [E_local, H, I_local]
its down projection; with `MoESpec.expert_bias` (gpt-oss), `b13` [E_local, 2 I_local] and `b2`
[E_local, H] their biases. That is transformers' fused `experts.gate_up_proj` / `experts.down_proj` layout
(written by `save_pretrained(save_original_format=False)`), so those load as slices; the hub's
per-expert `experts.N.{gate,up,down}_proj.weight` tensors (what `save_pretrained` writes by default, and
what Mixtral, Qwen1.5-MoE and Qwen3-MoE checkpoints hold) are stacked into it at load time.
gpt-oss's fused tensors (`MoESpec.gpt_oss_layout`: [E, H, 2I] with gate and up interleaved, and [E, I, H])
are transposed and de-interleaved at load, one expert at a time, keeping only this rank's shard.

Resident MXFP4 experts (`mxfp4=True`: an MXFP4 checkpoint served by the Triton kernels) keep the hub's
4-bit bytes instead: `w13` uint8 [E_local, 2 I_local, H / 2] and `w13_scales` [E_local, 2 I_local, H / 32]
(the gate rows, then the up rows, de-interleaved at load), `w2` uint8 [E_local, H, I_local / 2] and
`w2_scales` [E_local, H, I_local / 32]: every row packed along the reduction, as triton_mxfp4.py reads
it. A TP slice of the intermediate dimension is then a slice of down_proj's 32-value blocks, so it must
keep whole blocks (`check_mxfp4_split`).

Resident FP8 experts (`fp8_block` given: a block-scaled FP8 checkpoint served by the Triton kernels) keep
the checkpoint's float8_e4m3fn weights in the dense layout, with float32 scales per block beside them:
`w13_scales` [E_local, 2 ceil(I_local / b0), ceil(H / b1)] (the gate's block rows, then the up's) and
`w2_scales` [E_local, ceil(H / b0), ceil(I_local / b1)], as triton_fp8.py reads them. Each rank's
slice of the intermediate dimension starts on a block (`check_fp8_split`), so its scales are a slice of
the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.layers.source import TensorSource, check_shape
from tandem.engine.layers.weight_scales import WeightScales
from tandem.engine.moe.activation import gated
from tandem.engine.moe.routing import route
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.fp8_format import FP8, DequantSource
from tandem.engine.quant.mxfp4 import BLOCK, Mxfp4Source, dequantize

# Shard ids of the fused layout's two tensors; per-expert tensors use 3 * expert + kind.
FUSED_GATE_UP, FUSED_DOWN = -1, -2
_KINDS = ("gate_proj", "up_proj", "down_proj")

# (module, shard id, is_bias), as CausalLM.loaders() lists them.
Entry = tuple[Any, int, bool]


class MoEExperts(nn.Module):
    """The experts this rank holds (`ExpertShard`), and their forward: each token's top-k experts, weighted,
    summed. The output is this rank's partial sum; the MoE layer all-reduces it once.

    On CUDA with Triton (`kernels` given), one fused path with no host synchronization (fused.py);
    otherwise a torch path that is also free of host synchronization (so CUDA graphs can capture it),
    at the price of running every local expert over every token."""

    def __init__(
        self,
        spec: MoESpec,
        shard: ExpertShard,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        fused: Any = None,
        mxfp4: bool = False,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.spec, self.shard, self.hidden_size, self.dtype = spec, shard, hidden_size, dtype
        e, i = shard.num_local, shard.inter_size
        self.mxfp4, self.fp8_block = mxfp4, fp8_block
        self.w13_scales: nn.Parameter | None = None
        self.w2_scales: nn.Parameter | None = None
        if fp8_block is not None:  # the checkpoint's FP8 weights, float32 scales per block
            b0, b1 = fp8_block
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=FP8, device=device), False)
            self.w2 = nn.Parameter(torch.empty(e, hidden_size, i, dtype=FP8, device=device), False)
            self.w13_scales = _scales((e, 2 * _blocks(i, b0), _blocks(hidden_size, b1)), device)
            self.w2_scales = _scales((e, _blocks(hidden_size, b0), _blocks(i, b1)), device)
        elif mxfp4:  # packed along the reduction: H for gate/up, I for down
            check_mxfp4_split(spec, shard, hidden_size)
            self.w13 = _bytes((e, 2 * i, hidden_size // 2), device)
            self.w13_scales = _bytes((e, 2 * i, hidden_size // BLOCK), device)
            self.w2 = _bytes((e, hidden_size, i // 2), device)
            self.w2_scales = _bytes((e, hidden_size, i // BLOCK), device)
        else:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype, device=device), False)
            self.w2 = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype, device=device), False)
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if spec.expert_bias:
            self.b13 = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype, device=device), False)
            self.b2 = nn.Parameter(torch.empty(e, hidden_size, dtype=dtype, device=device), False)
        # The down projection's bias is added once per token: by the rank holding the first slice of the
        # intermediate dimension (under expert parallelism every rank, for the experts it holds).
        self.adds_down_bias = shard.inter_start == 0
        self.fused = fused  # fused.FusedMoE, or None for the torch path

    # ---- loading -------------------------------------------------------------------------------------
    def checkpoint_entries(self, prefix: str, available: Collection[str]) -> dict[str, Entry]:
        """The checkpoint names this module loads, in the layout the checkpoint has (`available` are its
        names): the fused pair where it has them, else every expert's three tensors. Experts of other
        ranks are listed too, so loading accepts them; `load` skips them without reading."""
        if self.spec.gpt_oss_layout:
            entries = {
                f"{prefix}.gate_up_proj": (self, FUSED_GATE_UP, False),
                f"{prefix}.down_proj": (self, FUSED_DOWN, False),
            }
            if self.spec.expert_bias:
                entries[f"{prefix}.gate_up_proj_bias"] = (self, FUSED_GATE_UP, True)
                entries[f"{prefix}.down_proj_bias"] = (self, FUSED_DOWN, True)
            return entries
        if f"{prefix}.gate_up_proj" in available:
            return {
                f"{prefix}.gate_up_proj": (self, FUSED_GATE_UP, False),
                f"{prefix}.down_proj": (self, FUSED_DOWN, False),
            }
        return {
            f"{prefix}.{e}.{kind}.weight": (self, 3 * e + k, False)
            for e in range(self.spec.num_experts)
            for k, kind in enumerate(_KINDS)
        }

    def check_fp8_split(self, block: tuple[int, int] | None, shard_id: int, name: str) -> None:
        """Raise ValueError, naming the fix, where this rank's slice of a block-scaled FP8 expert weight
        would cut a scale block: every rank must hold whole blocks of the intermediate dimension (the
        rows of gate/up, the columns of down), as a kernel that reads FP8 weights with their block
        scales needs. Per-channel and per-tensor scales split anywhere."""
        if shard_id < 0:
            raise ValueError(
                f"FP8 tensor {name!r}: FP8 experts load from the per-expert layout "
                "(experts.N.{gate,up,down}_proj.weight with weight_scale_inv), not the fused one"
            )
        if block is None:
            return
        s, full = self.shard, self.spec.expert_intermediate_size
        step = block[1] if shard_id % 3 == 2 else block[0]
        end = s.inter_start + s.inter_size
        if s.inter_start % step or (end % step and end != full):
            raise ValueError(
                f"FP8 tensor {name!r}: this rank's rows [{s.inter_start}, {end}) of the experts' "
                f"intermediate size {full} cut its {step}-wide scale blocks; pick a tp_size that "
                f"splits {full} into multiples of {step}, or enable_expert_parallel=True"
            )

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        s, full, hidden = self.shard, self.spec.expert_intermediate_size, self.hidden_size
        lo, size, experts = s.inter_start, s.inter_size, self.spec.num_experts
        if self.spec.gpt_oss_layout:
            self._load_gpt_oss(source, shard_id, is_bias=is_bias)
            return
        if shard_id == FUSED_GATE_UP:
            what = "the experts' fused gate/up projection"
            block = _experts_of(source, s, (experts, 2 * full, hidden), what)
            self.w13.data[:, :size].copy_(block[:, lo : lo + size])
            self.w13.data[:, size:].copy_(block[:, full + lo : full + lo + size])
            return
        if shard_id == FUSED_DOWN:
            block = _experts_of(source, s, (experts, hidden, full), "the experts' fused down projection")
            self.w2.data.copy_(block[:, :, lo : lo + size])
            return
        expert, kind = divmod(shard_id, 3)
        if not s.is_local(expert):
            return  # another rank's expert (expert parallelism)
        local = expert - s.expert_start
        if self.fp8_block is not None:
            self._load_fp8(source, expert, kind)
            return
        if kind == 2:
            check_shape(source, (hidden, full), f"expert {expert}'s down projection")
            self.w2.data[local].copy_(source.read(1, lo, size))
            return
        check_shape(source, (full, hidden), f"expert {expert}'s {_KINDS[kind]}")
        self.w13.data[local, kind * size : (kind + 1) * size].copy_(source.read(0, lo, size))

    def _load_fp8(self, source: TensorSource, expert: int, kind: int) -> None:
        """One expert's projection as the checkpoint stores it: this rank's FP8 rows (gate/up) or columns
        (down) and the scale blocks that cover them."""
        s, full, hidden = self.shard, self.spec.expert_intermediate_size, self.hidden_size
        assert self.fp8_block is not None and self.w13_scales is not None and self.w2_scales is not None
        name = f"expert {expert}'s {_KINDS[kind]}"
        if not isinstance(source, DequantSource) or source.block != self.fp8_block:
            raise ValueError(
                f"{name}: FP8 experts held in FP8 load the checkpoint's float8_e4m3fn weight with its "
                f"weight_scale_inv per {self.fp8_block} block; this tensor has none"
            )
        local, lo, size = expert - s.expert_start, s.inter_start, s.inter_size
        if kind == 2:
            check_shape(source, (hidden, full), name)
            weight, scales = source.read_fp8(1, lo, size)
            self.w2.data[local].copy_(weight)
            self.w2_scales.data[local].copy_(scales)
            return
        check_shape(source, (full, hidden), name)
        weight, scales = source.read_fp8(0, lo, size)
        self.w13.data[local, kind * size : (kind + 1) * size].copy_(weight)
        rows = scales.shape[0]
        self.w13_scales.data[local, kind * rows : (kind + 1) * rows].copy_(scales)

    def _load_gpt_oss(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        """gpt-oss's tensors, one local expert at a time (an MXFP4 source dequantizes only what is read):
        gate_up_proj [E, H, 2I] (+ bias [E, 2I]), gate and up interleaved, so this rank's intermediate
        rows [lo, lo + size) are the columns [2 lo, 2 (lo + size)); down_proj [E, I, H] (+ bias [E, H])."""
        s, full, hidden = self.shard, self.spec.expert_intermediate_size, self.hidden_size
        experts = self.spec.num_experts
        lo, size = s.inter_start, s.inter_size
        gate_up = shard_id == FUSED_GATE_UP
        what = "the experts' " + ("gate/up" if gate_up else "down") + (" bias" if is_bias else " projection")
        if is_bias:
            check_shape(source, (experts, 2 * full) if gate_up else (experts, hidden), what)
        elif gate_up:
            check_shape(source, (experts, hidden, 2 * full), what)
        else:
            check_shape(source, (experts, full, hidden), what)
        if self.mxfp4 and not is_bias:
            if not isinstance(source, Mxfp4Source):
                raise ValueError(
                    f"{what}: resident MXFP4 experts load an MXFP4 checkpoint's blocks and scales"
                )
            self._load_packed(source, gate_up)
            return
        for local in range(s.num_local):
            block = source.read(0, s.expert_start + local, 1)[0]
            if gate_up:
                cols = block[..., 2 * lo : 2 * (lo + size)]  # [2 size] or [H, 2 size]
                target = self.b13 if is_bias else self.w13
                assert target is not None
                gate, up = cols[..., 0::2], cols[..., 1::2]
                target.data[local, :size].copy_(gate if is_bias else gate.T)
                target.data[local, size:].copy_(up if is_bias else up.T)
            elif is_bias:
                assert self.b2 is not None
                self.b2.data[local].copy_(block)
            else:
                self.w2.data[local].copy_(block[lo : lo + size].T)

    def _load_packed(self, source: Mxfp4Source, gate_up: bool) -> None:
        """The hub's bytes as they are, this rank's part of them: gate_up_proj's rows [2 lo, 2 (lo + size))
        (gate and up interleaved: the even rows are gate's), down_proj's blocks of K [lo, lo + size)."""
        s = self.shard
        lo, size = s.inter_start, s.inter_size
        assert self.w13_scales is not None and self.w2_scales is not None
        for local in range(s.num_local):
            blocks, scales = source.read_packed(s.expert_start + local)  # [rows, G, 16], [rows, G]
            if gate_up:
                rows, row_scales = blocks[2 * lo : 2 * (lo + size)], scales[2 * lo : 2 * (lo + size)]
                self.w13.data[local, :size].copy_(rows[0::2].flatten(-2))
                self.w13.data[local, size:].copy_(rows[1::2].flatten(-2))
                self.w13_scales.data[local, :size].copy_(row_scales[0::2])
                self.w13_scales.data[local, size:].copy_(row_scales[1::2])
            else:
                first, end = lo // BLOCK, (lo + size) // BLOCK
                self.w2.data[local].copy_(blocks[:, first:end].flatten(-2))
                self.w2_scales.data[local].copy_(scales[:, first:end])

    def expert_weights(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `local`'s (w13, w2) in the compute dtype: resident MXFP4 or FP8 ones dequantized
        (the torch path; the kernels read the bytes)."""
        if self.w13_scales is None or self.w2_scales is None:
            return self.w13[local], self.w2[local]
        w13, w2 = self.w13[local], self.w2[local]
        if self.fp8_block is not None:
            size, rows = self.shard.inter_size, self.w13_scales.shape[1] // 2
            s13 = self.w13_scales[local]
            gate = WeightScales(s13[:rows], self.fp8_block).dequantize(w13[:size])
            up = WeightScales(s13[rows:], self.fp8_block).dequantize(w13[size:])
            down = WeightScales(self.w2_scales[local], self.fp8_block).dequantize(w2)
            return torch.cat((gate, up)).to(self.dtype), down.to(self.dtype)
        dense13 = dequantize(w13.view(w13.shape[0], -1, BLOCK // 2), self.w13_scales[local])
        dense2 = dequantize(w2.view(w2.shape[0], -1, BLOCK // 2), self.w2_scales[local])
        return dense13.to(self.dtype), dense2.to(self.dtype)

    # ---- forward -------------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        pdl: bool = False,
        score_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's part of sum_j w_j expert_j(x) for router `logits` [T, E], plus
        sigmoid(shared_gate) * shared where a shared expert's (partial) output is given, or shared alone
        without a gate (DeepSeek's shared experts): [T, H]. `pdl`:
        the fused kernels may launch with programmatic dependent launch (a small decode graph's plan).
        `score_bias`: the "sigmoid_grouped" router's correction bias, for the choice only."""
        if self.fused is not None:
            # The kernels route by the ungrouped scorings themselves; a grouped one's choice is made here.
            choice = route(logits, self.spec, score_bias) if self.spec.grouped else None
            has_gate = shared_gate is not None
            out: torch.Tensor = self.fused(
                x, logits, self.w13, self.w2, shared if has_gate else None, shared_gate, pdl,
                b13=self.b13, b2=self.b2, s13=self.w13_scales, s2=self.w2_scales, choice=choice,
                fp8_block=self.fp8_block,
            )  # fmt: skip
            return out if has_gate or shared is None else out + shared
        weights, ids = route(logits, self.spec, score_bias)
        out = self._torch_experts(x, weights, ids)
        if shared is not None and shared_gate is not None:
            out = out + torch.sigmoid(shared_gate) * shared
        elif shared is not None:
            out = out + shared
        return out

    def _torch_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every local expert over every token, each output kept where the token chose that expert, added
        in expert order as HF transformers adds them (so float32 CPU runs round alike)."""
        size = self.shard.inter_size
        out = torch.zeros_like(x)
        local = ids - self.shard.expert_start
        for e in range(self.shard.num_local):
            hit = local == e  # [T, k]: each expert appears at most once per token
            weight = (weights * hit).sum(dim=-1, keepdim=True)
            w13, w2 = self.expert_weights(e)
            gate_up = F.linear(x, w13, None if self.b13 is None else self.b13[e])
            down_bias = self.b2[e] if self.b2 is not None and self.adds_down_bias else None
            y = F.linear(gated(gate_up[:, :size], gate_up[:, size:], self.spec), w2, down_bias)
            out += torch.where(hit.any(dim=-1, keepdim=True), y * weight, 0.0).to(x.dtype)
        return out


def _experts_of(
    source: TensorSource, shard: ExpertShard, shape: tuple[int, int, int], what: str
) -> torch.Tensor:
    """This rank's experts [E_local, a, b] of a fused [E, a, b] tensor. One stored as [E, b, a] (the
    transposed layout some exporters write) is accepted where a != b makes that unambiguous."""
    experts, a, b = shape
    if a != b and source.shape == (experts, b, a):
        return source.read(0, shard.expert_start, shard.num_local).transpose(1, 2)
    check_shape(source, shape, what)
    return source.read(0, shard.expert_start, shard.num_local)


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _scales(shape: tuple[int, int, int], device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)


def _bytes(shape: tuple[int, int, int], device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device), requires_grad=False)


def check_mxfp4_split(spec: MoESpec, shard: ExpertShard, hidden: int) -> None:
    """Raise ValueError, naming the fix, where resident MXFP4 experts would cut a 32-value block: the
    hidden size (gate/up's reduction) and this rank's slice of the intermediate dimension (down's
    reduction) must hold whole blocks."""
    full, lo, end = spec.expert_intermediate_size, shard.inter_start, shard.inter_start + shard.inter_size
    if hidden % BLOCK:
        raise ValueError(f"MXFP4 experts: hidden_size {hidden} is not a multiple of {BLOCK}")
    if lo % BLOCK or shard.inter_size % BLOCK:
        raise ValueError(
            f"MXFP4 experts: this rank's rows [{lo}, {end}) of the experts' intermediate size {full} cut "
            f"its {BLOCK}-value blocks; pick a tp_size that splits {full} into multiples of {BLOCK}, "
            "or enable_expert_parallel=True"
        )
