"""Prefix caching for models with sliding-window layers: the window-aware radix tree and what requests
take from it and hand to it."""
