"""Tiny random-weight HF models (six families) for tests, and the trained demo model `tandem serve` serves."""

from .factory import FAMILIES, default_model_dir, make_tiny_model, tiny_config
from .tokenizer import EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, SPECIAL_TOKENS, load_tiny_tokenizer

__all__ = [
    "EOS_TOKEN",
    "FAMILIES",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "SPECIAL_TOKENS",
    "default_model_dir",
    "load_tiny_tokenizer",
    "make_tiny_model",
    "tiny_config",
]
