"""Where each layer's LoRA A and B live in one adapter slot, on this rank, and how an adapter's tensors are
read into that layout: sharded as the base weight is, padded to `max_lora_rank`, B scaled.

One slot is one flat buffer of the model dtype. For each column- or row-parallel layer it holds
A [slices x R, in] (a merged q/k/v or gate/up layer stacks one A per slice: they share the input) and
B [out, R] (the slices' rows back to back, as the layer's output is), with R = max_lora_rank. A column
layer keeps B's rows of its output shard and all of A; a row layer keeps A's columns of its input shard
and all of B, so its partial delta is summed by the layer's one all-reduce. Ranks below R are zero
padded, which adds nothing to the product; the delta's scale (alpha / r, or alpha / sqrt(r)) is folded
into B. Slot loads are then one copy of one buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from tandem.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine.layers.source import SafetensorsSource
from tandem.engine.lora.peft_format import PeftAdapter
from tandem.engine.models.attention import Attention
from tandem.engine.models.common import MLP, CausalLM

_ALIGN = 64  # elements: every block starts 128 bytes into its slot (16-bit), whatever the shapes


@dataclass(frozen=True)
class LoraSlice:
    """One projection inside a layer's output: `size` rows at `offset` of the local output, which are rows
    `start`.. of the projection's full output (column-parallel; 0 for a row-parallel layer)."""

    proj: str
    offset: int
    size: int
    start: int


@dataclass(frozen=True)
class LinearLayout:
    """One layer's A and B in a slot: A at `a_offset`, [len(slices) x rank, in_features]; B at
    `b_offset`, [out_features, rank]."""

    layer: int
    row_parallel: bool
    slices: tuple[LoraSlice, ...]
    in_features: int  # this rank's input width (a row layer's shard)
    in_start: int  # the first column of the full input this rank reads (row layers; 0 otherwise)
    out_features: int  # this rank's output width
    rank: int
    a_offset: int
    b_offset: int

    @property
    def a_rows(self) -> int:
        return len(self.slices) * self.rank

    @property
    def a_numel(self) -> int:
        return self.a_rows * self.in_features

    @property
    def b_numel(self) -> int:
        return self.out_features * self.rank


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _column_slices(linear: ColumnParallelLinear, projs: tuple[str, ...]) -> tuple[LoraSlice, ...]:
    return tuple(
        LoraSlice(proj, offset, shard.size, shard.start)
        for proj, offset, shard in zip(projs, linear.offsets, linear.shards, strict=True)
    )


class LoraLayout:
    """The slot layout of one model on one rank: its linear layers in order, each with its `LinearLayout`."""

    def __init__(self, linears: list[tuple[torch.nn.Module, LinearLayout]], slot_numel: int) -> None:
        self.linears = linears
        self.slot_numel = slot_numel
        self._where = {
            (lay.layer, s.proj): (i, j)
            for i, (_, lay) in enumerate(linears)
            for j, s in enumerate(lay.slices)
        }

    @classmethod
    def of(cls, model: CausalLM, rank: int) -> LoraLayout:
        linears: list[tuple[torch.nn.Module, LinearLayout]] = []
        offset = 0
        for i in range(len(model.model.layers)):
            layer = model.model.layer(i)
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(attn, Attention):
                raise ValueError(f"LoRA adapters are not supported for {model.config.architecture}'s "
                                 "latent attention")  # fmt: skip
            parts: list[tuple[torch.nn.Module, tuple[str, ...]]] = [
                (attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                (attn.o_proj, ("o_proj",)),
            ]
            if isinstance(mlp, MLP):  # a mixture-of-experts layer's experts take no adapter (peft_format)
                parts += [(mlp.gate_up_proj, ("gate_proj", "up_proj")), (mlp.down_proj, ("down_proj",))]
            for linear, projs in parts:
                if isinstance(linear, ColumnParallelLinear):
                    slices = _column_slices(linear, projs)
                    row, in_features, in_start = False, linear.in_features, 0
                    out = sum(s.size for s in slices)
                else:
                    assert isinstance(linear, RowParallelLinear)
                    slices = (LoraSlice(projs[0], 0, linear.out_features, 0),)
                    row, in_features, in_start = True, linear.in_size, linear.in_start
                    out = linear.out_features
                a_offset = offset
                a_numel = len(slices) * rank * in_features
                b_offset = a_offset + _aligned(a_numel)
                offset = b_offset + _aligned(out * rank)
                linears.append(
                    (
                        linear,
                        LinearLayout(i, row, slices, in_features, in_start, out, rank, a_offset, b_offset),
                    )
                )
        return cls(linears, offset)

    def views(self, store: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A [S, slices x R, in], B [S, out, R]) of each linear, as views of `store` [S, slot_numel]."""
        slots = store.shape[0]
        out = []
        for _, lay in self.linears:
            a = store[:, lay.a_offset : lay.a_offset + lay.a_numel].view(slots, lay.a_rows, lay.in_features)
            b = store[:, lay.b_offset : lay.b_offset + lay.b_numel].view(slots, lay.out_features, lay.rank)
            out.append((a, b))
        return out

    def read(self, adapter: PeftAdapter, into: torch.Tensor) -> None:
        """Write `adapter`'s deltas for this rank into `into` ([slot_numel], zeroed), reading from the
        weights file only the rows or columns this rank keeps."""
        flat = into.view(1, -1)
        views = self.views(flat)
        with safe_open(str(adapter.weights), framework="pt", device="cpu") as handle:
            for module in adapter.modules:
                i, j = self._where[(module.layer, module.proj)]
                lay = self.linears[i][1]
                a_view, b_view = views[i][0][0], views[i][1][0]
                piece = lay.slices[j]
                a_src = SafetensorsSource(module.a_name, handle)
                b_src = SafetensorsSource(module.b_name, handle)
                r = module.rank
                if lay.row_parallel:
                    a = a_src.read(1, lay.in_start, lay.in_features)
                    b = b_src.read()
                else:
                    a = a_src.read()
                    b = b_src.read(0, piece.start, piece.size)
                a_view[j * lay.rank : j * lay.rank + r].copy_(a)
                rows = b_view[piece.offset : piece.offset + piece.size, :r]
                rows.copy_(b.float() * module.scale)
