"""The KV pool's capacity in words, for `tandem serve` to print once the replicas are up."""

from __future__ import annotations

from tandem.scheduler.runtime import RuntimeLimits


def kv_capacity_message(limits: RuntimeLimits, kv_cache_dtype: str = "auto") -> str:
    """E.g. "KV cache: 1,234,560 tokens per replica (77,160 pages of 16 tokens, fp8_e4m3)". The tokens
    are those of the full-attention layers' pool (a window group, where a model has one, holds its
    window per request on top). `kv_cache_dtype` is the option as given: FP8 holds twice bf16's tokens."""
    full = [g for g in limits.groups if g.window is None] or list(limits.groups)
    pages = min(g.num_pages for g in full)
    tokens = pages * limits.page_size
    dtype = "model dtype" if kv_cache_dtype == "auto" else kv_cache_dtype
    return f"KV cache: {tokens:,} tokens per replica ({pages:,} pages of {limits.page_size} tokens, {dtype})"
