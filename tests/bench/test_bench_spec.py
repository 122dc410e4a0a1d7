"""benchmarks/spec.py's CPU smoke run, so the script cannot rot: the replay drafter's acceptance follows p
(nothing accepted at p = 1, more as p falls), output stays the plain run's, and the result file carries
every field the GPU run reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.benchmarks.spec import ACCEPT_LENGTHS, main, replace_probability


def test_replace_probability_gives_the_mean_accepted_length() -> None:
    for length in (2.0, 3.0, 4.0):
        q = 1 - replace_probability(length, 4)
        assert 1 + sum(q**i for i in range(1, 5)) == pytest.approx(length, abs=1e-9)
    assert replace_probability(1, 4) == 1.0
    assert replace_probability(2, 1) == pytest.approx(0.0, abs=1e-9)  # K = 1: every draft must hit


def test_smoke_run_writes_every_field(tmp_path: Path) -> None:
    path = main(["--smoke", "--tokens", "16", "--out-dir", str(tmp_path), "--model-dir", str(tmp_path / "m")])
    result = json.loads(path.read_text())
    assert result["benchmark"] == "spec-smoke" and result["config"]["num_speculative_tokens"] == 4
    assert result["commit"] and result["device"]["torch"]
    plain = result["plain"]
    assert plain["b1_ms_per_token"] > 0 and plain["b2_ms_per_token"] > 0
    measured = []
    for length in ACCEPT_LENGTHS:
        row = result[f"accept_len_{length}"]
        for b in (1, 2):
            assert row[f"b{b}_output_equals_plain"], (length, b)  # greedy stays the target's
            assert row[f"b{b}_ratio"] == pytest.approx(
                row[f"b{b}_ms_per_token"] / plain[f"b{b}_ms_per_token"]
            )
        measured.append(row["b2_accept_len"])
    assert measured[0] == 1.0  # p = 1: no draft is ever the target's token
    assert measured[-1] > measured[0] and max(measured) <= 5.0
    assert result["zero_accept_overhead"] == result["accept_len_1"]["b1_ratio"]
    ngram = result["ngram_demo_model"]
    assert ngram["output_equals_plain"] and ngram["accept_len"] > 1.5  # the recited text hits
