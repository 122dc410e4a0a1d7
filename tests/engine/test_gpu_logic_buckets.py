"""The GPU path, checked on CPU: which batch sizes and token counts get CUDA graphs, and how batches
are padded."""

from __future__ import annotations

import itertools

import pytest

from tandem.engine.graph_buckets import decode_batch_sizes, padded_size, token_buckets


def test_decode_sizes() -> None:
    sizes = decode_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in itertools.pairwise(sizes))
    assert decode_batch_sizes(3) == [1, 2, 3]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        decode_batch_sizes(0)


@pytest.mark.parametrize("max_tokens", [1, 5, 100, 2048, 3000, 8192])
def test_token_buckets_cover_every_count(max_tokens: int) -> None:
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for n in range(1, max_tokens + 1, 7):
        size = padded_size(n, buckets)
        assert size is not None and n <= size
        # Padding waste stays bounded: under 16 tokens or 1/8 of the padded batch.
        assert size - n < max(16, size // 8)
    assert padded_size(max_tokens + 1, buckets) is None


def test_padded_size_picks_the_smallest_fit() -> None:
    assert padded_size(1, [1, 2, 4, 8]) == 1
    assert padded_size(3, [1, 2, 4, 8]) == 4
    assert padded_size(8, [1, 2, 4, 8]) == 8
    assert padded_size(9, [1, 2, 4, 8]) is None
