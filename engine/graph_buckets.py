"""Which shapes get a CUDA graph: padded batch sizes for decode, token-count buckets for prefill.

A batch runs on the smallest captured shape that holds it; the gaps between shapes bound the padding
waste (at most 8 rows for decode; about 6-12% of tokens for prefill), and fewer shapes mean less
capture time and graph memory.
"""

from __future__ import annotations

import bisect


def decode_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_bs` (itself always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_bs}
    sizes.update(range(16, max_bs + 1, 8))
    sizes.add(max_bs)
    return sorted(sizes)


# (upper bound, step): fine steps where launch overhead dominates, coarser ones where compute does.
_TOKEN_STEPS = ((32, 8), (256, 16), (512, 32), (1024, 64), (2048, 128), (4096, 256), (1 << 30, 512))


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture piecewise graphs for, up to `max_tokens` (itself always included)."""
    if max_tokens < 1:
        raise ValueError(f"piecewise_max_tokens must be >= 1, got {max_tokens}")
    buckets: list[int] = []
    value = 0
    for upper, step in _TOKEN_STEPS:
        while value + step <= min(upper, max_tokens):
            value += step
            buckets.append(value)
        if value >= max_tokens:
            break
    if not buckets or buckets[-1] != max_tokens:
        buckets.append(max_tokens)
    return buckets


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n, or None when n is larger than every captured size."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
