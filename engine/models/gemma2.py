"""Gemma 2: alternating window/global layers, attention and final logit soft-capping, sandwich
norms with (1 + w) scales, and embeddings scaled by sqrt(hidden_size)."""

from tandem.engine.models.common import CausalLM
from tandem.engine.models.context import Traits


class Gemma2ForCausalLM(CausalLM):
    traits = Traits(gemma_norm=True, sandwich_norms=True, embed_scale=True)
