"""Qwen2 / Qwen2.5: the Llama block with a bias on q, k and v (attention_bias from the config)."""

from tandem.engine.models.common import CausalLM


class Qwen2ForCausalLM(CausalLM):
    pass
