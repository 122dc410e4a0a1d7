"""Tensor-parallel linear layers: column-parallel (merged QKV, gate/up) and row-parallel.

Shard sizes are worked out once, in the constructor. A parameter's `load` reads only this rank's
slice of each checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.distributed import TPGroup
from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.layers.low_rank import GemvDelta
from tandem.engine.layers.source import TensorSource, check_shape
from tandem.engine.layers.weight_scales import WeightScales

# (x, weight, bias or None) -> x weight^T (+ bias).
MatMul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class OutputDelta(Protocol):
    """What a layer adds to its own output for the rows of a batch (engine/lora/delta.py's `LoraDelta`)."""

    slice_offsets: tuple[int, ...]  # where each slice of the delta starts in the layer's output

    def add(self, x: torch.Tensor, out: torch.Tensor, plan: KernelPlan) -> None: ...

    def fold(self, x: torch.Tensor, plan: KernelPlan) -> GemvDelta | None:
        """The delta as the Triton GEMV's epilogue adds it (its first half run now, on x), or None where
        this delta is not folded: then the layer calls `add` after its GEMM."""
        ...


@dataclass(frozen=True)
class OutputShard:
    """One merged output of a column-parallel layer: its full size and the rows this rank keeps."""

    full: int
    start: int
    size: int


def even_shard(full: int, tp: TPGroup) -> OutputShard:
    start, size = tp.shard(full)
    return OutputShard(full, start, size)


def head_shard(num_heads: int, head_dim: int, tp: TPGroup) -> OutputShard:
    """Heads split over ranks; with fewer heads than ranks, each rank keeps a replica of one head."""
    if num_heads >= tp.size:
        start, per_rank = tp.shard(num_heads)
    else:
        if tp.size % num_heads:
            raise ValueError(f"{num_heads} KV heads cannot be replicated over tp_size={tp.size}")
        start, per_rank = tp.rank * num_heads // tp.size, 1
    return OutputShard(num_heads * head_dim, start * head_dim, per_rank * head_dim)


def matmul_with_delta(
    layer: ColumnParallelLinear | RowParallelLinear,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    plan: KernelPlan,
) -> torch.Tensor:
    """The layer's GEMM, plus its LoRA delta under a plan with `lora`. The GEMM is the Triton GEMV or
    tinygemm where the plan and the weight's shape say so (the GEMV first: its plans are the smaller
    graphs), else the layer's own matmul; the delta goes into the GEMV's epilogue where it folds, saving
    a launch in one-row decode graphs."""
    kernels = layer.kernels
    delta = layer.lora if plan.lora else None
    if kernels is not None and plan.gemv and layer.gemv_fits:
        folds = delta is not None and kernels.gemv_folds(x, layer.weight, delta.slice_offsets)
        folded = delta.fold(x, plan) if delta is not None and folds else None
        out = kernels.gemv(x, layer.weight, bias, plan, folded, layer.gemv_scales)
        if folded is not None:
            return out
    elif kernels is not None and plan.tinygemm and layer.tinygemm_fits:
        out = kernels.tinygemm(x, layer.weight, bias, plan)
    else:
        out = layer.matmul(x, layer.weight, bias)
    if delta is not None:
        delta.add(x, out, plan)
    return out


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), with the output dimension split over ranks. No communication."""

    def __init__(
        self,
        in_features: int,
        shards: Sequence[OutputShard],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        matmul: MatMul = F.linear,
        kernels: FusedKernels | None = None,
    ) -> None:
        super().__init__()
        self.matmul = matmul
        self.kernels = kernels
        self.in_features = in_features
        self.shards = tuple(shards)
        self.offsets = [sum(s.size for s in self.shards[:i]) for i in range(len(self.shards))]
        local = sum(s.size for s in self.shards)
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(local, dtype=dtype, device=device), False) if bias else None
        # Whether a plan with `gemv` / `tinygemm` may run this layer's GEMM so: decided once, by shape.
        self.gemv_fits = kernels is not None and kernels.gemv_fits(self.weight)
        self.tinygemm_fits = kernels is not None and kernels.tinygemm_fits(self.weight)
        # An FP8 weight's scales, for the GEMV that reads its bytes (quant/fp8_linear.py sets them).
        self.gemv_scales: WeightScales | None = None
        # The LoRA delta of each row's adapter (B's rows of this rank's output shard), set by the engine
        # when LoRA is on; added under plans with `lora`.
        self.lora: OutputDelta | None = None

    @property
    def output_sizes(self) -> list[int]:
        return [s.size for s in self.shards]

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        shard = self.shards[shard_id]
        target = self.bias if is_bias else self.weight
        assert target is not None
        expected = (shard.full,) if is_bias else (shard.full, self.in_features)
        check_shape(source, expected, f"shard {shard_id} of a column-parallel layer")
        rows = source.read(0, shard.start, shard.size)
        offset = self.offsets[shard_id]
        target.data[offset : offset + shard.size].copy_(rows)

    def forward(self, x: torch.Tensor, plan: KernelPlan = EAGER) -> torch.Tensor:
        return matmul_with_delta(self, x, self.bias, plan)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b: the layer's one all-reduce; only rank 0 adds the bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        matmul: MatMul = F.linear,
        kernels: FusedKernels | None = None,
    ) -> None:
        super().__init__()
        self.matmul = matmul
        self.kernels = kernels
        self.tp = tp
        self.out_features = out_features
        self.in_start, self.in_size = tp.shard(in_features)
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_size, dtype=dtype, device=device), False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        )
        self.gemv_fits = kernels is not None and kernels.gemv_fits(self.weight)
        self.tinygemm_fits = kernels is not None and kernels.tinygemm_fits(self.weight)
        # An FP8 weight's scales, for the GEMV that reads its bytes (quant/fp8_linear.py sets them).
        self.gemv_scales: WeightScales | None = None
        # The LoRA delta (A's columns of this rank's input shard): summed by the one all-reduce below.
        self.lora: OutputDelta | None = None

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        if is_bias:
            assert self.bias is not None
            check_shape(source, (self.out_features,), "a row-parallel bias")
            self.bias.data.copy_(source.read())
            return
        check_shape(source, (self.out_features, self.in_features), "a row-parallel layer")
        self.weight.data.copy_(source.read(1, self.in_start, self.in_size))

    def forward(self, x: torch.Tensor, plan: KernelPlan = EAGER, *, reduce: bool = True) -> torch.Tensor:
        """`reduce=False` leaves this rank's partial sum, for a caller that adds more to it before the one
        all-reduce (an MoE layer's shared expert)."""
        bias = self.bias if self.tp.rank == 0 else None
        out = matmul_with_delta(self, x, bias, plan)
        return self.tp.all_reduce(out) if reduce else out
