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


def test_the_console_line_says_the_interval_mean_acceptance_length() -> None:
    from tandem.deploy.observability.spec_metrics import LOG_INTERVAL_S, acceptance_line

    sink = SpecMetrics("m")
    first = {
        "spec_decode_num_drafts": 4,
        "spec_decode_num_draft_tokens": 12,
        "spec_decode_num_accepted_tokens": 2,
        "spec_decode_num_accepted_tokens_per_pos": [2, 0, 0],
    }
    later = {
        "spec_decode_num_drafts": 14,
        "spec_decode_num_draft_tokens": 42,
        "spec_decode_num_accepted_tokens": 22,
        "spec_decode_num_accepted_tokens_per_pos": [10, 8, 4],
    }
    assert sink.console_line({"num_running": 0}, 0.0) is None  # no speculation: no line, ever
    assert sink.console_line(first, 0.0) is None  # the first snapshot starts the interval
    assert sink.console_line(later, LOG_INTERVAL_S / 2) is None  # too soon
    line = sink.console_line(later, LOG_INTERVAL_S)
    # Over the interval: 10 drafted rows, 20 of 30 draft tokens accepted, so 3.00 tokens per row.
    assert line is not None and "mean acceptance length 3.00" in line
    assert "accepted 20 of 30 draft tokens (66.7%)" in line and "rate 0.80, 0.80, 0.40" in line
    assert sink.console_line(later, 3 * LOG_INTERVAL_S) is None  # nothing verified since
    since_start = acceptance_line(later, {})  # 14 rows, 22 accepted: 1 + 22 / 14
    assert since_start is not None and "mean acceptance length 2.57" in since_start
