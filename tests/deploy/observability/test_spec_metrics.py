"""The speculative-decoding counters: registered only once the ranks report drafts, fed increments of
the ranks' cumulative counts, per position too."""

from __future__ import annotations

from typing import Any

import pytest
from ray.util import metrics

from tandem.deploy.observability.spec_metrics import SPEC_METRIC_NAMES, SpecMetrics


class _Counter:
    made: list[_Counter] = []

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
        self.name = name
        self.incs: list[tuple[int, dict[str, str]]] = []
        _Counter.made.append(self)

    def inc(self, value: int, tags: dict[str, str]) -> None:
        self.incs.append((value, tags))


def test_counters_take_increments_and_exist_only_with_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "Counter", _Counter)
    _Counter.made.clear()
    sink = SpecMetrics("m")
    sink.sample({"num_running": 1})  # no speculation: nothing registered
    assert _Counter.made == []

    def snapshot(drafts: int, tokens: int, accepted: int, per_pos: list[int]) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_num_accepted_tokens_per_pos": per_pos,
        }

    sink.sample(snapshot(2, 6, 3, [2, 1, 0]))
    sink.sample(snapshot(5, 15, 7, [4, 2, 1]))
    by_name = {c.name: c for c in _Counter.made}
    assert sorted(by_name) == sorted(SPEC_METRIC_NAMES)
    tags = {"model_name": "m"}
    assert by_name["tandem_spec_decode_num_draft_tokens_total"].incs == [(6, tags), (9, tags)]
    assert by_name["tandem_spec_decode_num_accepted_tokens_total"].incs == [(3, tags), (4, tags)]
    per_pos = by_name["tandem_spec_decode_num_accepted_tokens_per_pos_total"].incs
    assert sum(v for v, t in per_pos if t["position"] == "0") == 4
    assert sum(v for v, t in per_pos if t["position"] == "2") == 1


def test_stats_over_replicas_sum_the_accepts_and_recompute_the_mean() -> None:
    from tandem.deploy.observability.stats import aggregate_stats

    one = {
        "spec_decode_num_drafts": 2,
        "spec_decode_num_draft_tokens": 6,
        "spec_decode_num_accepted_tokens": 4,
        "spec_decode_num_accepted_tokens_per_pos": [2, 1, 1],
        "spec_decode_mean_acceptance_length": 3.0,
    }
    two = {**one, "spec_decode_num_drafts": 6, "spec_decode_num_accepted_tokens": 0}
    two["spec_decode_num_accepted_tokens_per_pos"] = [0, 0, 0]
    two["spec_decode_mean_acceptance_length"] = 1.0
    total = aggregate_stats([one, two])
    assert total["spec_decode_num_accepted_tokens_per_pos"] == [2, 1, 1]
    assert total["spec_decode_mean_acceptance_length"] == 1.0 + 4 / 8
