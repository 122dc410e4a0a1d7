"""What a mixture-of-experts architecture declares in its HF `config.json`, read once into `MoESpec`, and
how its experts are split over the ranks (`ExpertShard`).

Torch-free, so `ModelConfig` and the option checks can read it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# How a router turns its logits into (expert, weight) pairs: a softmax over all experts, then the top k
# (Mixtral, Qwen); or the top k logits, then a softmax over those k (gpt-oss).
Scoring = Literal["softmax_topk", "topk_softmax"]
# The experts' gated activation: silu(gate) * up; or gpt-oss's clamped SwiGLU,
# gate.clamp(max=limit) * sigmoid(alpha * gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1).
Activation = Literal["silu", "swiglu_clamped"]


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of one model. `sparse_layers[i]` says whether layer i has them (else a dense MLP
    of `intermediate_size`, as Qwen2-MoE's `mlp_only_layers` and `decoder_sparse_step` ask)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # divide the top-k weights by their sum (Mixtral always; Qwen's `norm_topk_prob`)
    sparse_layers: tuple[bool, ...]
    # Qwen2-MoE: a dense expert every token passes through, scaled by sigmoid(x . shared_expert_gate).
    shared_expert_intermediate_size: int = 0
    scoring: Scoring = "softmax_topk"
    router_bias: bool = False  # the router is a linear layer with a bias (gpt-oss)
    expert_bias: bool = False  # every expert's gate/up and down projections have biases (gpt-oss)
    activation: Activation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # transformers' gpt-oss layout of the fused expert tensors: gate_up_proj [E, H, 2I] with gate and up
    # interleaved (even and odd columns), down_proj [E, I, H]; x @ W rather than x W^T.
    gpt_oss_layout: bool = False

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]

    @classmethod
    def from_raw(cls, raw: dict[str, Any], num_layers: int) -> MoESpec | None:
        """The spec of an HF config, or None for a dense model. Mixtral sizes its experts with
        `intermediate_size` and always renormalizes; the Qwen MoE families size them with
        `moe_intermediate_size` and renormalize where `norm_topk_prob` says so. The expert count is
        `num_experts` or `num_local_experts` (transformers writes either, depending on its version)."""
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        if experts <= 0:
            return None
        if raw.get("model_type") == "mixtral" or not raw.get("moe_intermediate_size"):
            size, renormalize = int(raw["intermediate_size"]), True
        else:
            size, renormalize = int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False))
        top_k = int(raw.get("num_experts_per_tok", 2))
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, {experts}] (the experts)")
        if raw.get("model_type") == "gpt_oss":
            return cls(
                num_experts=experts,
                top_k=top_k,
                expert_intermediate_size=int(raw["intermediate_size"]),
                renormalize=False,  # the softmax over the chosen k already sums to one
                sparse_layers=(True,) * num_layers,
                scoring="topk_softmax",
                router_bias=True,
                expert_bias=True,
                activation="swiglu_clamped",
                swiglu_alpha=float(raw.get("swiglu_alpha") or 1.702),
                swiglu_limit=float(raw.get("swiglu_limit") or 7.0),
                gpt_oss_layout=True,
            )
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return cls(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=size,
            renormalize=renormalize,
            sparse_layers=sparse,
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        )


@dataclass(frozen=True)
class ExpertShard:
    """The experts [expert_start, expert_start + num_local) this rank holds, each with the rows
    [inter_start, inter_start + inter_size) of its intermediate dimension.

    Tensor parallelism: every rank holds every expert and a 1/N slice of each one's intermediate
    dimension. Expert parallelism: every rank holds N-th of the experts, whole. Either way each rank's
    output is a partial sum over the experts, and one all-reduce finishes the layer."""

    expert_start: int
    num_local: int
    inter_start: int
    inter_size: int

    @classmethod
    def of(cls, spec: MoESpec, rank: int, size: int, *, expert_parallel: bool) -> ExpertShard:
        check_expert_split(spec, size, expert_parallel=expert_parallel)
        if expert_parallel:
            per_rank = spec.num_experts // size
            return cls(rank * per_rank, per_rank, 0, spec.expert_intermediate_size)
        part = spec.expert_intermediate_size // size
        return cls(0, spec.num_experts, rank * part, part)

    def is_local(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local


def check_expert_split(spec: MoESpec, size: int, *, expert_parallel: bool) -> None:
    """Raise ValueError, naming the fix, when the experts cannot be split evenly over `size` ranks."""
    if expert_parallel and spec.num_experts % size:
        raise ValueError(
            f"enable_expert_parallel needs num_experts ({spec.num_experts}) to divide by tp_size ({size}), "
            "so that every rank holds the same number of whole experts; pick a tp_size that divides it"
        )
    if not expert_parallel and spec.expert_intermediate_size % size:
        raise ValueError(
            f"the experts' intermediate size ({spec.expert_intermediate_size}) does not divide by "
            f"tp_size ({size}); pick a tp_size that divides it, or enable_expert_parallel=True"
        )
