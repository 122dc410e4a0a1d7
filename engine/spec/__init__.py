"""Speculative decoding on the engine's side: draft verification, and hidden-state drafters (EAGLE-3, MTP)."""
