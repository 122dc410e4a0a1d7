"""OpenAI batch lines: what is a request, and the output lines, as OpenAI's Batch API writes them."""

from __future__ import annotations

import json

import pytest

from tandem.deploy.batch.lines import BatchRequest, LineError, error_line, parse_line, response_line


def line(**fields: object) -> str:
    base: dict[str, object] = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "x"},
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...})


def test_a_request_line() -> None:
    assert parse_line(line()) == BatchRequest("c1", "/v1/completions", {"prompt": "x"})
    chat = parse_line(line(url="/v1/chat/completions", body=[1]))
    assert chat == BatchRequest("c1", "/v1/chat/completions", [1])  # the body is the API's to judge


@pytest.mark.parametrize(
    ("text", "code", "param", "custom_id"),
    [
        ("{oops", "invalid_json", None, None),
        ("[1, 2]", "invalid_request", None, None),
        (line(custom_id=...), "invalid_request", "custom_id", None),
        (line(custom_id=7), "invalid_request", "custom_id", None),
        (line(custom_id=""), "invalid_request", "custom_id", None),
        (line(body=...), "invalid_request", "body", "c1"),
        (line(method="GET"), "invalid_request", "method", "c1"),
        (line(url="/v1/embeddings"), "invalid_url", "url", "c1"),
        (line(extra=1), "invalid_request", "extra", "c1"),
    ],
)
def test_lines_that_are_not_requests(text: str, code: str, param: str | None, custom_id: str | None) -> None:
    error = parse_line(text)
    assert isinstance(error, LineError)
    assert (error.code, error.param, error.custom_id) == (code, param, custom_id)
    out = json.loads(error_line(error))
    assert set(out) == {"id", "custom_id", "response", "error"} and out["id"].startswith("batch_req_")
    assert out["response"] is None and out["custom_id"] == custom_id
    assert out["error"]["code"] == code and out["error"]["message"]


def test_response_lines() -> None:
    body = {
        "error": {"message": "no", "type": "invalid_request_error", "param": "n", "code": "invalid_value"}
    }
    out = json.loads(response_line("c9", 400, body))
    assert out["custom_id"] == "c9" and out["error"] is None
    assert out["response"]["status_code"] == 400 and out["response"]["body"] == body
    assert out["response"]["request_id"].startswith("req_")
    assert json.loads(response_line("c9", 200, {"a": "é"}))["response"]["body"] == {"a": "é"}


def test_a_lone_surrogate_echoed_back_stays_writable() -> None:
    error = parse_line('{"custom_id": "\\ud800", "method": "PUT", "url": "/v1/completions", "body": {}}')
    assert isinstance(error, LineError)
    text = error_line(error)
    text.encode("utf-8")  # would raise if the surrogate were written raw
    assert json.loads(text)["custom_id"] == "\ud800"
