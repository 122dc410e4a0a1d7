"""`tandem batch` on OpenAI batch files (CPU): each valid line's response is the HTTP server's answer to
the same body, each invalid line or body gets one error line, and a 1,000-line file finishes, in order.
The real server runs once for the module, on the same Ray instance the batch jobs use."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray.data import DataContext

from tandem.deploy.batch.batch_file import run_batch_file
from tandem.deploy.batch.config import ProcessorConfig

SERVED = "tiny-batch"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog"

# custom_id -> (url, body): bodies the server answers, and bodies it refuses.
BODIES: dict[str, tuple[str, Any]] = {
    "cmpl": (COMPLETIONS, {"model": SERVED, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
    "cmpl-ids": (
        COMPLETIONS,
        {"model": SERVED, "prompt": [5, 17, 99, 230], "max_tokens": 6, "temperature": 0},
    ),
    "cmpl-n-logprobs": (
        COMPLETIONS,
        {"model": SERVED, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": 2},
    ),
    "chat": (
        CHAT,
        {
            "model": SERVED,
            "messages": [{"role": "user", "content": "Tell me about foxes."}],
            "max_tokens": 10,
        },
    ),
    "chat-stop": (
        CHAT,
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_completion_tokens": 16,
            "temperature": 0,
            "stop": ["o"],
        },
    ),
    "bad-temperature": (COMPLETIONS, {"model": SERVED, "prompt": "x", "temperature": -1}),
    "bad-model": (COMPLETIONS, {"model": "no-such-model", "prompt": "x"}),
    "too-long": (COMPLETIONS, {"model": SERVED, "prompt": "x", "max_tokens": 10**6}),
    "no-messages": (CHAT, {"model": SERVED, "max_tokens": 4}),
    "not-an-object": (CHAT, [1, 2, 3]),
}
GREEDY = {"cmpl", "cmpl-ids", "cmpl-n-logprobs", "chat-stop"}  # "chat" samples at T=1: its shape only
BAD_LINES = {
    "{not json": "invalid_json",
    json.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {}}): "invalid_url",
    json.dumps({"method": "POST", "url": COMPLETIONS, "body": {}}): "invalid_request",
    json.dumps({"custom_id": "get", "method": "GET", "url": COMPLETIONS, "body": {}}): "invalid_request",
}


def request_line(custom_id: str, url: str, body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def same(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-4: a logprob's last float32 digits depend on what else was in the batch."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def server(serve_app_context: Any, model: str) -> Iterator[Any]:
    with serve_app_context({"model": model, "served_model_name": SERVED, "device": "cpu"}) as app:
        context = DataContext.get_current()
        saved = context.enable_progress_bars
        context.enable_progress_bars = False
        yield app
        context.enable_progress_bars = saved


@pytest.fixture(scope="module")
def http_answers(server: Any) -> dict[str, tuple[int, dict[str, Any]]]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        answers = {}
        for custom_id, (url, body) in BODIES.items():
            response = client.post(url, json=body)
            answers[custom_id] = (response.status_code, response.json())
    return answers


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_are_answered_as_the_http_server_answers_them(
    server: Any, model: str, http_answers: dict[str, tuple[int, dict[str, Any]]], tmp_path: Path
) -> None:
    lines = [request_line(c, url, body) for c, (url, body) in BODIES.items()]
    lines.insert(3, next(iter(BAD_LINES)))
    lines += list(BAD_LINES)[1:]
    stream = {"model": SERVED, "prompt": "x", "stream": True}
    lines.append(request_line("stream", COMPLETIONS, stream))
    source, target = tmp_path / "in.jsonl", tmp_path / "out" / "out.jsonl"
    source.write_text("\n".join(lines) + "\n\n")  # a blank line is not a request: no output for it
    config = ProcessorConfig(model_source=model, device="cpu", batch_size=4)
    summary = run_batch_file(str(source), str(target), config, served_model_name=SERVED)
    out = read_lines(target)
    assert len(out) == len(lines) == summary.lines
    assert (summary.answered, summary.invalid) == (5, len(BAD_LINES))
    assert summary.refused == len(BODIES) - 5 + 1
    for sent, got in zip(lines, out):  # one output line per input line, in order
        assert set(got) == {"id", "custom_id", "response", "error"} and got["id"].startswith("batch_req_")
        if sent in BAD_LINES:
            assert got["response"] is None and got["error"]["code"] == BAD_LINES[sent]
            continue
        custom_id = json.loads(sent)["custom_id"]
        assert got["custom_id"] == custom_id and got["error"] is None
        response = got["response"]
        assert response["request_id"].startswith("req_")
        if custom_id == "stream":
            assert response["status_code"] == 400 and response["body"]["error"]["param"] == "stream"
            continue
        status, body = http_answers[custom_id]
        assert response["status_code"] == status, custom_id
        if status != 200:
            assert response["body"] == body, custom_id  # the server's error body, word for word
        elif custom_id in GREEDY:
            assert same(without_ids(response["body"]), without_ids(body)), (custom_id, response["body"], body)
        else:
            assert set(response["body"]) == set(body) and response["body"]["object"] == body["object"]
            assert response["body"]["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


def test_a_thousand_line_file_through_the_command(server: Any, model: str, tmp_path: Path) -> None:
    bad_at = {
        100: "{broken",
        555: request_line("bad-555", COMPLETIONS, {"model": SERVED, "prompt": ""}),
        999: "[]",
    }
    lines = [
        bad_at.get(i)
        or request_line(f"req-{i}", COMPLETIONS, {"model": SERVED, "prompt": f"line {i}", "max_tokens": 2})
        for i in range(1000)
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    address = ray.get_runtime_context().gcs_address
    command = ["tandem", "batch", "-i", str(source), "-o", f"file://{target}", "--model", model]
    command += ["--served-model-name", SERVED, "--device", "cpu", "--concurrency", "2", "--address", address]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "wrote 1000 lines" in done.stderr and "997 answered, 1 refused by the API, 2 invalid" in done.stderr
    )
    out = read_lines(target)
    assert len(out) == 1000
    for i, got in enumerate(out):
        if i in (100, 999):
            assert got["custom_id"] is None and got["response"] is None and got["error"]["code"]
        elif i == 555:
            assert got["custom_id"] == "bad-555" and got["response"]["status_code"] == 400
        else:
            assert got["custom_id"] == f"req-{i}" and got["response"]["status_code"] == 200
            choice = got["response"]["body"]["choices"][0]
            assert choice["finish_reason"] in ("length", "stop")
