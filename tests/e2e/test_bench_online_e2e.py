"""`tandem bench online` against a real tandem Serve app on loopback (CPU, tiny model): the sweep, the
JSON it writes, failures counted rather than raised, and the serve-overhead measurement."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.benchmarks import online
from tandem.benchmarks.loadgen import synthetic_requests

SERVED = "tiny-bench"


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[tuple[Any, Path]]:  # type: ignore[no-untyped-def]
    # serve_app_context starts Ray once for this module (ray.init(num_cpus=8)) and shuts it down after.
    model = tiny_model_dir("qwen3")
    args = {
        "model": str(model),
        "served_model_name": SERVED,
        "device": "cpu",
        "engine": {"page_size": 4},
        "max_ongoing_requests": 16,
        "max_queued_requests": 64,
    }
    with serve_app_context(args, name="tandem-bench-e2e") as running:
        yield running, model


def vocab_of(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def test_sweep_and_serve_overhead(app: tuple[Any, Path], tmp_path: Path) -> None:
    running, model = app
    vocab = vocab_of(model) - 3  # below the special tokens
    argv = ["--base-url", running.base_url, "--model", SERVED, "--concurrency", "1,3", "--num-prompts", "6"]
    argv += [
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--random-range-ratio",
        "0.25",
        "--vocab-size",
        str(vocab),
    ]
    argv += ["--warmup-requests", "1", "--goodput-ttft-ms", "60000", "--goodput-tpot-ms", "60000"]
    argv += [
        "--point-timeout-s",
        "60",
        "--max-duration-s",
        "150",
        "--results-dir",
        str(tmp_path),
        "--tag",
        "e2e",
    ]
    argv += ["--serve-overhead", "--overhead-requests", "5", "--overhead-model", str(model)]
    argv += ["--overhead-device", "cpu", "--overhead-engine", '{"page_size": 4}']
    assert online.main(argv) == 0

    doc = json.loads((tmp_path / "online-e2e.json").read_text())
    assert doc["mode"] == "concurrency" and [p["concurrency"] for p in doc["points"]] == [1, 3]
    assert doc["config"]["model"] == SERVED and doc["commit"]
    for index, point in enumerate(doc["points"]):
        assert point["completed"] == 6 and point["failed"] == 0 and point["not_sent"] == 0, point
        # ignore_eos: each request generates exactly its max_tokens, and usage reports it.
        specs = synthetic_requests(6, 16, 8, range_ratio=0.25, vocab_size=vocab, seed=index)
        assert point["total_output_tokens"] == sum(s.output_len for s in specs)
        assert point["total_input_tokens"] == sum(s.input_len for s in specs)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = point[key]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
        assert point["ttft_ms"]["p50"] < point["e2e_ms"]["p50"]
        assert point["goodput"] == pytest.approx(point["request_throughput"])
        assert point["output_throughput"] > 0
    overhead = doc["serve_overhead"]
    assert overhead["requests"] == 5 and overhead["failed"] == 0, overhead
    assert overhead["http_ttft_ms"]["p50"] > 0 and overhead["inprocess_ttft_ms"]["p50"] > 0
    assert overhead["overhead_ms_p50"] == pytest.approx(
        overhead["http_ttft_ms"]["p50"] - overhead["inprocess_ttft_ms"]["p50"], abs=1e-2
    )


def test_failures_are_counted_not_raised(app: tuple[Any, Path], tmp_path: Path) -> None:
    running, _ = app
    argv = ["--base-url", running.base_url, "--model", "no-such-model", "--rates", "50,inf"]
    argv += ["--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--warmup-requests", "0"]
    argv += ["--results-dir", str(tmp_path), "--tag", "bad", "--no-plot"]
    assert online.main(argv) == 1  # every request failed

    doc = json.loads((tmp_path / "online-bad.json").read_text())
    assert [p["rate"] for p in doc["points"]] == [50.0, "inf"]
    for point in doc["points"]:
        assert point["completed"] == 0 and point["failed"] == 3
        (message,) = point["errors"]
        assert message.startswith("HTTP 404") and point["errors"][message] == 3
        assert point["ttft_ms"]["p50"] is None and point["goodput"] == 0
