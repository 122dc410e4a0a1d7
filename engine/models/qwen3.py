"""Qwen3: the Llama block with RMS norms on q and k per head, before rope."""

from tandem.engine.models.common import CausalLM


class Qwen3ForCausalLM(CausalLM):
    pass
