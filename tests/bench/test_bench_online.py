"""`tandem bench online`: the pure pieces (SSE parsing, metrics, arrivals, request specs, the JSON)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.benchmarks import online, online_report
from tandem.benchmarks.loadgen import (
    DONE,
    RequestResult,
    RequestSpec,
    SSEParser,
    latency_stats,
    load_dataset,
    meets_slo,
    poisson_arrivals,
    request_body,
    sample_lengths,
    summarize,
    synthetic_requests,
)


def completion_event(text: str) -> str:
    return json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": text}]})


def usage_event(prompt: int, completion: int) -> str:
    return json.dumps({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})


# ---- SSE parsing ------------------------------------------------------------------------------------
def test_sse_whole_events() -> None:
    parser = SSEParser()
    stream = f"data: {completion_event('a')}\n\ndata: {completion_event('b')}\n\ndata: [DONE]\n\n"
    assert parser.feed(stream) == [completion_event("a"), completion_event("b"), DONE]
    assert parser.close() == []


def test_sse_events_split_anywhere_come_out_whole() -> None:
    stream = f"data: {completion_event('héllo')}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n"
    for size in (1, 2, 3, 7, 64):
        parser = SSEParser()
        payloads = []
        for i in range(0, len(stream), size):
            payloads += parser.feed(stream[i : i + size])
        payloads += parser.close()
        assert payloads == [completion_event("héllo"), DONE], size


def test_sse_multiline_data_fields_and_unterminated_tail() -> None:
    parser = SSEParser()
    assert parser.feed("event: x\ndata: one\ndata:two\nid: 3\n\n") == ["one\ntwo"]
    assert parser.feed("data: [DONE]") == []  # the server closed without the blank line
    assert parser.close() == [DONE]


def test_result_from_completion_stream() -> None:
    result = RequestResult(send_time=10.0, input_len=5)
    result.observe(completion_event("a"), 10.1)
    result.observe(completion_event(""), 10.15)  # a finish chunk with no text is not content
    result.observe(completion_event("b"), 10.2)
    result.observe(completion_event("c"), 10.4)
    result.observe(usage_event(5, 4), 10.4)
    result.observe(DONE, 10.5)
    result.finish(10.5)
    assert result.ok
    assert result.output_tokens == 4 and result.prompt_tokens == 5  # usage wins over the chunk count
    assert result.ttft == pytest.approx(0.1)
    assert result.itls == pytest.approx([0.1, 0.2])
    assert result.e2e == pytest.approx(0.5)
    assert result.tpot == pytest.approx((0.5 - 0.1) / 3)


def test_result_from_chat_stream_counts_chunks_without_usage() -> None:
    def chat(delta: dict[str, Any]) -> str:
        return json.dumps({"choices": [{"index": 0, "delta": delta}]})

    result = RequestResult(send_time=0.0, input_len=3)
    result.observe(chat({"role": "assistant", "content": ""}), 0.05)  # the role delta is not a token
    result.observe(chat({"content": "x"}), 0.2)
    result.observe(chat({"content": "y"}), 0.3)
    result.observe(chat({}), 0.3)
    result.observe(DONE, 0.31)
    result.finish(0.31)
    assert result.ok and result.output_tokens == 2
    assert result.ttft == pytest.approx(0.2)


def test_result_error_event_is_counted_not_raised() -> None:
    result = RequestResult(send_time=0.0, input_len=3)
    result.observe(completion_event("a"), 0.1)
    result.observe(
        json.dumps({"error": {"message": "rank died", "type": "x", "param": None, "code": 503}}), 0.2
    )
    result.observe("{not json", 0.3)
    result.observe(DONE, 0.3)
    result.finish(0.3)
    assert not result.ok and result.error == "error event: rank died"  # the first cause is kept


@pytest.mark.parametrize(
    ("events", "error"),
    [([completion_event("a")], "without [DONE]"), ([usage_event(3, 0), DONE], "no content")],
)
def test_result_incomplete_streams_fail(events: list[str], error: str) -> None:
    result = RequestResult(send_time=0.0, input_len=3)
    for payload in events:
        result.observe(payload, 0.1)
    result.finish(0.2)
    assert not result.ok and error in str(result.error)


# ---- metrics ----------------------------------------------------------------------------------------
def synthetic(ttft: float, tpot: float, tokens: int, send: float = 0.0) -> RequestResult:
    """A completed request whose chunks arrive exactly `tpot` apart after `ttft`."""
    result = RequestResult(send_time=send, input_len=8)
    for i in range(tokens):
        result.observe(completion_event("t"), send + ttft + i * tpot)
    result.observe(usage_event(8, tokens), send + ttft + (tokens - 1) * tpot)
    result.observe(DONE, send + ttft + (tokens - 1) * tpot)
    result.finish(send + ttft + (tokens - 1) * tpot)
    return result


def test_latency_stats_percentiles_in_ms() -> None:
    stats = latency_stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_single_token_is_undefined() -> None:
    one = synthetic(0.05, 0.01, 1)
    assert one.ok and one.tpot is None
    assert meets_slo(one, ttft_ms=100, tpot_ms=1)  # nothing to violate


def test_summary_throughput_and_goodput() -> None:
    results = [
        synthetic(0.1, 0.02, 11),  # TTFT 100 ms, TPOT 20 ms: meets both
        synthetic(0.3, 0.02, 11),  # misses the TTFT limit
        synthetic(0.1, 0.05, 11),  # misses the TPOT limit
        synthetic(0.1, 0.01, 11),  # meets both
    ]
    failed = RequestResult(send_time=0.0, input_len=8)
    failed.fail("HTTP 503: overloaded")
    failed.finish(0.01)
    summary = summarize([*results, failed], 2.0, ttft_slo_ms=200, tpot_slo_ms=30, not_sent=1)
    assert summary["completed"] == 4 and summary["failed"] == 1 and summary["not_sent"] == 1
    assert summary["errors"] == {"HTTP 503: overloaded": 1}
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["output_throughput"] == pytest.approx(44 / 2.0)
    assert summary["goodput"] == pytest.approx(1.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(20.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(20.0)
    e2e_ms = [r.e2e * 1e3 for r in results]  # 300, 500, 600, 200
    assert summary["e2e_ms"]["p99"] == pytest.approx(float(np.percentile(e2e_ms, 99)), abs=1e-3)
    # No limits: every completed request counts.
    assert summarize(results, 2.0)["goodput"] == pytest.approx(2.0)


# ---- arrivals and specs -----------------------------------------------------------------------------
def test_poisson_arrivals_seeded_with_the_mean_rate() -> None:
    arrivals = poisson_arrivals(8.0, 20_000, seed=3)
    assert arrivals == poisson_arrivals(8.0, 20_000, seed=3)
    assert arrivals != poisson_arrivals(8.0, 20_000, seed=4)
    assert arrivals[0] == 0.0 and bool(np.all(np.diff(arrivals) >= 0))
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(8.0, rel=0.03)
    gaps = np.diff(arrivals)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 3, seed=0)


def test_lengths_and_synthetic_prompts() -> None:
    rng = np.random.default_rng(0)
    assert sample_lengths(64, 0.0, 5, rng) == [64] * 5
    ranged = sample_lengths(100, 0.5, 2000, rng)
    assert min(ranged) >= 50 and max(ranged) <= 150 and 95 < np.mean(ranged) < 105
    specs = synthetic_requests(20, 16, 8, vocab_size=50, seed=1)
    assert specs == synthetic_requests(20, 16, 8, vocab_size=50, seed=1)
    assert all(isinstance(s.prompt, list) and len(s.prompt) == 16 and s.output_len == 8 for s in specs)
    assert all(0 <= t < 50 for s in specs for t in s.prompt)
    assert len({tuple(s.prompt) for s in specs}) == 20  # distinct: no prefix-cache flattery
    text = synthetic_requests(2, 10, 4, prompt_kind="text", seed=1)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 10 for s in text)


def test_dataset_lengths_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": [1, 2, 3], "output_len": 5}, {"prompt": "a b", "max_tokens": 7, "input_len": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = load_dataset(path, 3)
    assert specs == [RequestSpec([1, 2, 3], 3, 5), RequestSpec("a b", 9, 7), RequestSpec([1, 2, 3], 3, 5)]
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="output_len"):
        load_dataset(path, 1)


def test_request_body_is_streaming_with_usage() -> None:
    body = request_body(RequestSpec([1, 2], 2, 9), "m", "completions", 0.0)
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 9
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    chat = request_body(RequestSpec("hi", 1, 3), "m", "chat", 0.0)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat"):
        request_body(RequestSpec([1], 1, 1), "m", "chat", 0.0)


# ---- CLI and JSON -----------------------------------------------------------------------------------
def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        [],  # neither a load nor --serve-overhead
        ["--rates", "1", "--concurrency", "2"],
        ["--rates", "0"],
        ["--concurrency", "0"],
        ["--rates", "1", "--random-range-ratio", "1.5"],
        ["--rates", "1", "--endpoint", "chat"],
        ["--serve-overhead", "--overhead-engine", "[1]"],
    ):
        with pytest.raises(SystemExit) as exc:
            online.main(argv)
        assert exc.value.code == 2, argv
    help_text = online.build_parser().format_help()
    for action in online.build_parser()._actions:
        assert action.help, action.option_strings  # every flag is documented
    assert "--goodput-tpot-ms" in help_text


def test_json_has_device_commit_config_and_points(tmp_path: Path) -> None:
    args = online.build_parser().parse_args(["--rates", "1,inf", "--dataset", "x.jsonl", "--tag", "t"])
    points = [
        {"rate": 1.0, **summarize([synthetic(0.1, 0.02, 5)], 1.0)},
        {"rate": "inf", **summarize([synthetic(0.2, 0.03, 5)], 1.0)},
    ]
    result = {"mode": "rate", "points": points, "serve_overhead": None, "args": args}
    path = online_report.write(result, tmp_path, "t", plot=True)
    assert path == tmp_path / "online-t.json"
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "online_serving" and doc["mode"] == "rate"
    assert set(doc["device"]) >= {"cpu", "cpu_cores", "torch"} and doc["time_utc"]
    assert isinstance(doc["commit"], str) and doc["commit"]
    assert doc["config"]["rates"] == [1.0, "inf"] and doc["config"]["dataset"] == "x.jsonl"
    for point in doc["points"]:
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(point[key]) == {"mean", "p50", "p90", "p99"}
        for key in ("request_throughput", "output_throughput", "goodput", "completed", "failed"):
            assert key in point
    if doc["plot"] is not None:  # matplotlib is optional
        assert (tmp_path / doc["plot"]).stat().st_size > 0


def test_serve_overhead_paired_median_is_robust_to_host_stalls() -> None:
    from tandem.benchmarks.serve_overhead import Side, overhead_summary

    args = argparse.Namespace(overhead_input_len=32, overhead_max_tokens=4)
    # HTTP costs 1 ms more per pair; the host stalled for pairs 4-5 (both halves) and for pair 3's HTTP half.
    local = Side(ttft_s=[0.010, 0.010, 0.010, 0.030, 0.030])
    http = Side(ttft_s=[0.011, 0.011, 0.031, 0.031, 0.031])
    paired = overhead_summary(http, local, args, order="interleaved pairs", paired=True)
    assert paired["overhead_ms_paired_p50"] == pytest.approx(1.0)
    assert paired["overhead_ms_p50"] == pytest.approx(21.0)  # the medians moved apart
    assert paired["pair_differences_ms"] == pytest.approx([1.0, 1.0, 21.0, 1.0, 1.0])
    # Times alone, with a lost request, cannot be aligned: no paired figure, only the difference of medians.
    broken = overhead_summary(
        Side(ttft_s=http.ttft_s[1:], errors=["http: timeout"]),
        local,
        args,
        order="interleaved pairs",
        paired=True,
    )
    assert broken["overhead_ms_paired_p50"] is None and broken["failed"] == 1
    sides = overhead_summary(http, local, args, order="in-process, then HTTP")
    assert sides["overhead_ms_paired_p50"] is None


def test_serve_overhead_pairs_stay_aligned_past_a_failed_request() -> None:
    from tandem.benchmarks.serve_overhead import Side, overhead_summary

    args = argparse.Namespace(overhead_input_len=32, overhead_max_tokens=4)
    http, local, direct = Side(), Side(), Side()
    # Pair 1's HTTP request carried no text. Recorded per pair, the later pairs still line up.
    for h, d, i in [(0.011, 0.0105, 0.010), (None, 0.0205, 0.020), (0.031, 0.0305, 0.030)]:
        http.record(h, "http: no text")
        direct.record(d, None)
        local.record(i, None)
    summary = overhead_summary(http, local, args, order="interleaved pairs", paired=True, direct=direct)
    assert summary["failed"] == 1 and summary["pairs_counted"] == 2
    assert summary["overhead_ms_paired_p50"] == pytest.approx(1.0)
    assert summary["haproxy_share_ms_paired_p50"] == pytest.approx(0.5)
    assert summary["direct_overhead_ms_paired_p50"] == pytest.approx(0.5)


def test_overhead_pool_resamples_runs_not_only_pairs(tmp_path: Path) -> None:
    from tandem.benchmarks.overhead_pool import main, pool

    # Two runs that disagree: pairs alone would give a narrow interval around the pooled median;
    # resampling runs spans both runs' medians.
    runs = {"a": [1.0] * 100, "b": [3.0] * 100}
    result = pool(runs, draws=400)
    assert result["pairs"] == 200 and result["per_run_paired_p50_ms"] == {"a": 1.0, "b": 3.0}
    assert result["pooled_ci95_ms"] == [1.0, 3.0]
    for name, diffs in runs.items():
        (tmp_path / f"online-{name}.json").write_text(
            json.dumps({"commit": "abc", "serve_overhead": {"pair_differences_ms": diffs}})
        )
    files = [str(tmp_path / "online-a.json"), str(tmp_path / "online-b.json")]
    assert main([*files, "--tag", "pooled", "--results-dir", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "online-pooled.json").read_text())
    assert written["runs"] == 2
    assert [s["file"] for s in written["sources"]] == ["online-a.json", "online-b.json"]
    with pytest.raises(ValueError):
        pool({"a": []})


def test_replica_port_is_the_one_answering_routes_for_this_app() -> None:
    import http.server
    import threading

    from tandem.benchmarks.online_local_overhead import APP, _replica_port

    class Routes(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"/": APP if self.path == "/-/routes" else "other"}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert _replica_port(range(port, port + 1)) == port
        server.RequestHandlerClass = type("Other", (Routes,), {"do_GET": _answers_other_app})
        assert _replica_port(range(port, port + 1)) is None
    finally:
        server.shutdown()
        server.server_close()


def _answers_other_app(self: Any) -> None:
    body = b'{"/": "another-app"}'
    self.send_response(200)
    self.send_header("content-length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)
