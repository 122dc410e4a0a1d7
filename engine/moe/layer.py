"""The mixture-of-experts block, one module for every MoE family: the router's logits, the top-k choice,
the routed experts, and an optional shared expert, then one all-reduce.

Under tensor parallelism each rank holds a 1/N slice of every expert's intermediate dimension; under
expert parallelism N-th of the experts whole (`ExpertShard`). Attention stays tensor-parallel either way,
so every rank already holds every token's hidden state after the o projection's all-reduce: each rank
routes all tokens (the router is replicated), applies the experts it holds to the tokens that chose them,
and the partial sums meet in one all-reduce, the same collective and the same bytes as a dense MLP's
down projection. A shared expert is sharded like a dense MLP, its partial output (scaled by its sigmoid
gate, which is the same on every rank) joins that sum, so the layer has one collective in all.

Routers are kinds of `MoESpec.scoring` (spec.py): softmax top-k, gpt-oss's top-k then softmax (with a
router bias), and DeepSeek's grouped top-k over softmax (V2) or sigmoid scores with a correction bias
(V3, `ScoreBias`). DeepSeek's routers compute their logits in float32, as its checkpoints keep the router
weights. The Triton kernels (fused.py) route the ungrouped scorings themselves; for the grouped ones the
choice is made in torch (routing.py `route`, no host synchronization) and the kernels group and run the
given pairs. gpt-oss's biased experts and clamped SwiGLU are options of `MoEExperts`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.layers.source import TensorSource, check_shape
from tandem.engine.models.context import Build
from tandem.engine.moe.experts import MoEExperts
from tandem.engine.moe.spec import ExpertShard, MoESpec


class ScoreBias(nn.Module):
    """DeepSeek-V3's `e_score_correction_bias` [E]: added to the router's scores to choose the experts
    (to balance their load), never to weight them. The checkpoint keeps it under the router,
    `mlp.gate.e_score_correction_bias`; float32 as the checkpoints keep it."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device), False)

    def checkpoint_entries(self, prefix: str, available: Collection[str]) -> dict[str, tuple[Any, int, bool]]:
        return {f"{prefix.rpartition('.')[0]}.gate.e_score_correction_bias": (self, 0, True)}

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        check_shape(source, tuple(self.bias.shape), "the router's score correction bias")
        self.bias.data.copy_(source.read())


class MoE(nn.Module):
    """HF's `mlp` of a sparse layer: `gate` (the router), `experts`, and for Qwen2-MoE `shared_expert`
    with its `shared_expert_gate`, named as the checkpoints name them."""

    def __init__(self, b: Build, spec: MoESpec, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        c = b.config
        if c.hidden_act != "silu":
            raise ValueError(f"MoE experts run SiLU-gated MLPs; this model's hidden_act is {c.hidden_act!r}")
        self.tp = b.tp
        self.shard = ExpertShard.of(spec, b.tp.rank, b.tp.size, expert_parallel=b.expert_parallel)
        self.gate = b.replicated(c.hidden_size, spec.num_experts, bias=spec.router_bias)
        self.score_correction = (
            ScoreBias(spec.num_experts, b.device) if spec.scoring == "sigmoid_grouped" else None
        )
        self.spec = spec
        fused = None
        if b.kernels is not None and b.kernels.triton is not None:
            from tandem.engine.moe.fused import FusedMoE  # imports Triton: CUDA only

            fused = FusedMoE(spec, self.shard, c.hidden_size)
        self.experts = MoEExperts(
            spec,
            self.shard,
            c.hidden_size,
            dtype=b.dtype,
            device=b.device,
            fused=fused,
            mxfp4=b.mxfp4_experts,
            fp8_block=b.fp8_experts,
        )
        self.shared_expert = shared_expert
        gated = shared_expert is not None and spec.shared_expert_gated
        self.shared_expert_gate = b.replicated(c.hidden_size, 1) if gated else None

    def forward(self, x: torch.Tensor, plan: KernelPlan = EAGER) -> torch.Tensor:
        if self.spec.grouped:
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x, plan)  # [T, E] in the activation dtype, as HF computes them
        shared: torch.Tensor | None = None
        shared_gate: torch.Tensor | None = None
        if self.shared_expert is not None:
            shared = self.shared_expert(x, plan, reduce=False)
        if self.shared_expert_gate is not None:
            shared_gate = self.shared_expert_gate(x, plan)
        bias = None if self.score_correction is None else self.score_correction.bias
        return self.tp.all_reduce(self.experts(x, logits, shared, shared_gate, plan.pdl, bias))
