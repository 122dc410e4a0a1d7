"""Speculative decoding on the scheduler's side: the config, the drafters and the drafts of a batch."""
