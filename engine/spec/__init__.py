"""Speculative decoding on the engine's side: verification of a batch's drafts against the target."""
