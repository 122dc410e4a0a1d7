"""Tiny random-weight HF models (nine families, three of them MoE, plus DeepSeek-V2/V3 with latent
attention) for tests, and the demo model that `tandem serve` serves."""

from .factory import FAMILIES, MLA_FAMILIES, MOE_FAMILIES, default_model_dir, make_tiny_model, tiny_config
from .tokenizer import EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, SPECIAL_TOKENS, load_tiny_tokenizer

__all__ = [
    "EOS_TOKEN",
    "FAMILIES",
    "MLA_FAMILIES",
    "MOE_FAMILIES",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "SPECIAL_TOKENS",
    "default_model_dir",
    "load_tiny_tokenizer",
    "make_tiny_model",
    "tiny_config",
]
