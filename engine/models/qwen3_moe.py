"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 block (per-head q/k norms) with a mixture of
experts on the sparse layers, top-k weights renormalized where `norm_topk_prob` says so; no shared
expert."""

from tandem.engine.models.common import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    pass
