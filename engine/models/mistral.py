"""Mistral: the Llama block with a sliding window on every layer."""

from tandem.engine.models.common import CausalLM


class MistralForCausalLM(CausalLM):
    pass
