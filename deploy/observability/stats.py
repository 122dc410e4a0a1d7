"""Sum the `LLM.stats()` dicts of all LLMServer replicas into one, for `handle.stats.remote()`."""

from __future__ import annotations

from typing import Any

# Lists that hold one count per KV group: summed element-wise. Other lists (e.g. `kv_group_windows`)
# describe the model and are the same on every replica, so the first replica's is kept.
_SUMMED_LIST_SUFFIX = "_per_group"


def aggregate_stats(per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and gauges summed over replicas (`*_peak*` keys take the max), plus `num_replicas`."""
    total: dict[str, Any] = {}
    for stats in per_replica:
        for key, value in stats.items():
            if key not in total:
                total[key] = list(value) if isinstance(value, list) else value
                continue
            current = total[key]
            if isinstance(value, bool) or not isinstance(value, (int, float, list)):
                continue
            if isinstance(value, list):
                if key.endswith(_SUMMED_LIST_SUFFIX) and len(value) == len(current):
                    combine = max if "peak" in key else _add
                    total[key] = [combine(a, b) for a, b in zip(current, value)]
            else:
                total[key] = max(current, value) if "peak" in key else current + value
    total["num_replicas"] = len(per_replica)
    if total.get("spec_decode_num_drafts"):
        # Speculative decoding: accepts per draft position summed, and the mean recomputed from the sums.
        per_pos = [s.get("spec_decode_num_accepted_tokens_per_pos") or [] for s in per_replica]
        total["spec_decode_num_accepted_tokens_per_pos"] = [sum(c) for c in zip(*per_pos, strict=False)]
        drafts, accepted = total["spec_decode_num_drafts"], total["spec_decode_num_accepted_tokens"]
        total["spec_decode_mean_acceptance_length"] = 1.0 + accepted / drafts
    if any("prefix_cache_query_tokens" in stats for stats in per_replica):
        # Where the prompts went: each replica's prefix-cache lookups (its prompt tokens) and hits.
        keys = ("prefix_cache_query_tokens", "prefix_cache_hit_tokens")
        total["per_replica_prefix_cache"] = [{k: stats.get(k, 0) for k in keys} for stats in per_replica]
    return total


def _add(a: Any, b: Any) -> Any:
    return a + b
