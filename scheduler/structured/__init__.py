"""Structured outputs on a rank: xgrammar compiles and matchers, bitmask fills, and strict JSON strings."""
