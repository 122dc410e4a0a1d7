"""The mixture-of-experts block, one module for every MoE family: the router's logits, the top-k choice,
the routed experts, and an optional shared expert, then one all-reduce.

Under tensor parallelism each rank holds a 1/N slice of every expert's intermediate dimension; under
expert parallelism N-th of the experts whole (`ExpertShard`). Attention stays tensor-parallel either way,
so every rank already holds every token's hidden state after the o projection's all-reduce: each rank
routes all tokens (the router is replicated), applies the experts it holds to the tokens that chose them,
and the partial sums meet in one all-reduce, the same collective and the same bytes as a dense MLP's
down projection. A shared expert is sharded like a dense MLP, its partial output (scaled by its sigmoid
gate, which is the same on every rank) joins that sum, so the layer has one collective in all.

A later router (DeepSeek's grouped top-k, scores with a bias) is a new `MoESpec.scoring` kind and a new
expert activation a new option of `MoEExperts`, not another layer.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.models.context import Build
from tandem.engine.moe.experts import MoEExperts
from tandem.engine.moe.spec import ExpertShard, MoESpec


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
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = b.replicated(c.hidden_size, 1) if shared_expert is not None else None

    def forward(self, x: torch.Tensor, plan: KernelPlan = EAGER) -> torch.Tensor:
        logits = self.gate(x, plan)  # [T, E] in the activation dtype, as HF computes them
        shared: torch.Tensor | None = None
        shared_gate: torch.Tensor | None = None
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x, plan, reduce=False)
            shared_gate = self.shared_expert_gate(x, plan)
        return self.tp.all_reduce(self.experts(x, logits, shared, shared_gate, plan.pdl))
