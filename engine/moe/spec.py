"""What a mixture-of-experts architecture declares in its HF `config.json`, read once into `MoESpec`, and
how its experts are split over the ranks (`ExpertShard`).

Torch-free, so `ModelConfig` and the option checks can read it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# How a router turns its logits into (expert, weight) pairs (routing.py `route`):
# - "softmax_topk": softmax over the experts, the top k (Mixtral, the Qwen MoE families);
# - "topk_softmax" (gpt-oss): the top k logits, then a softmax over those k;
# - "softmax_grouped" (DeepSeek-V2): softmax; the experts split into `num_groups` groups, each scored by
#   its best expert, only the `topk_groups` best groups compete for the top k (one group: plain top k);
# - "sigmoid_grouped" (DeepSeek-V3, Kimi K2): sigmoid scores; a per-expert bias
#   (`e_score_correction_bias`) added for the choice only; each group scored by the sum of its two best
#   biased scores; the top k of the kept groups, weighted by their unbiased scores.
# Both grouped kinds renormalize where `renormalize` says and then multiply by `routed_scaling_factor`.
Scoring = Literal["softmax_topk", "topk_softmax", "softmax_grouped", "sigmoid_grouped"]
# The experts' gated activation: silu(gate) * up; or gpt-oss's clamped SwiGLU,
# gate.clamp(max=limit) * sigmoid(alpha * gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1).
Activation = Literal["silu", "swiglu_clamped"]

# DeepSeek configs: (topk_method, scoring_func) pairs this code implements, per scoring.
_DEEPSEEK_V2_METHODS = ("greedy", "group_limited_greedy")
_DEEPSEEK_V3_METHODS = ("noaux_tc",)


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
    # The grouped scorings (DeepSeek): groups of experts, how many of them compete, the weights' factor.
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Whether the shared expert's output is scaled by sigmoid(x . shared_expert_gate) (Qwen2-MoE) or
    # added as it is (DeepSeek's `shared_experts`).
    shared_expert_gated: bool = True

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]

    @property
    def grouped(self) -> bool:
        """Whether the router scores groups of experts (DeepSeek): its logits are float32 and its choice
        is made in torch (routing.py `route`), then handed to the Triton kernels, which route the
        ungrouped scorings themselves."""
        return self.scoring in ("softmax_grouped", "sigmoid_grouped")

    @classmethod
    def from_raw(cls, raw: dict[str, Any], num_layers: int) -> MoESpec | None:
        """The spec of an HF config, or None for a dense model. Mixtral sizes its experts with
        `intermediate_size` and always renormalizes; the Qwen MoE families size them with
        `moe_intermediate_size` and renormalize where `norm_topk_prob` says so. The expert count is
        `num_experts` or `num_local_experts` (transformers writes either, depending on its version)."""
        if raw.get("n_routed_experts"):
            return _deepseek(raw, num_layers)
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


def _deepseek(raw: dict[str, Any], num_layers: int) -> MoESpec:
    """DeepSeek-V2/V3 (and Kimi K2, a V3): `n_routed_experts` of `moe_intermediate_size`,
    `n_shared_experts` of that size as one ungated shared expert, dense layers before
    `first_k_dense_replace` and off the `moe_layer_freq` step. A `topk_method` or `scoring_func` this
    code does not implement fails here, by name."""
    experts, top_k = int(raw["n_routed_experts"]), int(raw.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, {experts}] (the experts)")
    v3 = raw.get("model_type") != "deepseek_v2"
    methods = _DEEPSEEK_V3_METHODS if v3 else _DEEPSEEK_V2_METHODS
    method = raw.get("topk_method") or methods[0]
    if method not in methods:
        raise ValueError(f"unsupported topk_method {method!r} for {raw.get('model_type')}; supported: "
                         f"{', '.join(methods)}")  # fmt: skip
    scoring_func = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring_func != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"unsupported scoring_func {scoring_func!r} for {raw.get('model_type')}")
    grouped = v3 or method == "group_limited_greedy"
    groups = int(raw.get("n_group") or 1) if grouped else 1
    topk_groups = int(raw.get("topk_group") or 1) if grouped else 1
    if experts % groups or not 1 <= topk_groups <= groups:
        raise ValueError(f"n_group={groups} must divide n_routed_experts={experts}, and topk_group="
                         f"{topk_groups} lie in [1, n_group]")  # fmt: skip
    if topk_groups * (experts // groups) < top_k:
        raise ValueError(f"topk_group={topk_groups} groups hold fewer than num_experts_per_tok={top_k}")
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    step = int(raw.get("moe_layer_freq") or 1)
    size = int(raw["moe_intermediate_size"])
    return MoESpec(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=size,
        renormalize=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(i >= first_dense and i % step == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=size * int(raw.get("n_shared_experts") or 0),
        scoring="sigmoid_grouped" if v3 else "softmax_grouped",
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        shared_expert_gated=False,
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
