"""Offline batch inference over Ray Data: the `tandem.batch` processor and OpenAI batch files."""
