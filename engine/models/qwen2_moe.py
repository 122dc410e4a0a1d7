"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 block (q/k/v biases) whose MLP is, on the layers
`decoder_sparse_step` and `mlp_only_layers` pick, a mixture of experts with top-k weights renormalized
only with `norm_topk_prob`, plus a shared expert scaled by its sigmoid gate."""

from tandem.engine.models.common import CausalLM


class Qwen2MoeForCausalLM(CausalLM):
    pass
