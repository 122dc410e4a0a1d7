"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the request's
own suffix. Host-side, from tokens the host already has, so it never waits on the device."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def propose_ngram(tokens: npt.NDArray[np.int64], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens`: for the longest suffix of length n in
    [min_n, max_n] that occurs earlier, the tokens after its latest earlier occurrence (the most recent
    context predicts best: a recited passage continues where it was last seen). Empty when none occurs."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start before the suffix itself and leave at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            found: list[int] = tokens[start : start + k].tolist()
            return found
    return []
