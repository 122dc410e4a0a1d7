"""Llama and Llama 3.1: the baseline (rope scaling and tied embeddings come from the config)."""

from tandem.engine.models.common import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
