"""Gemma 3 (text): Gemma 2's block plus q/k norms, a layer-type pattern (5 local : 1 global) and a
separate rope base for the local layers; both come from the config."""

from tandem.engine.models.common import CausalLM
from tandem.engine.models.context import Traits


class Gemma3ForCausalLM(CausalLM):
    traits = Traits(gemma_norm=True, sandwich_norms=True, embed_scale=True)
