"""OpenAI's batch file format: one request per input line, one result per output line.

An input line is `{"custom_id", "method": "POST", "url", "body"}`. An output line is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, as OpenAI's Batch API
writes them: a request the API answered, even with a 4xx, has a `response` whose body is the API's own
(an error body for a 4xx) and `error: null`; a line that is not a request at all (not JSON, a missing
field, an unknown url) has `response: null` and an `error` object saying why.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions")
_FIELDS = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: Any


@dataclass(frozen=True)
class LineError:
    """Why a line is not a request; `custom_id` when the line had a readable one."""

    code: str
    message: str
    param: str | None = None
    custom_id: str | None = None

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param}


def parse_line(text: str) -> BatchRequest | LineError:
    try:
        line = json.loads(text)
    except ValueError as exc:
        return LineError("invalid_json", f"the line is not valid JSON: {exc}")
    if not isinstance(line, dict):
        return LineError("invalid_request", f"a line must be a JSON object, got {type(line).__name__}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError("invalid_request", "custom_id must be a non-empty string", "custom_id")
    unknown = sorted(set(line) - set(_FIELDS))
    if unknown:
        return LineError("invalid_request", f"unknown field(s) {', '.join(unknown)}", unknown[0], custom_id)
    missing = [name for name in _FIELDS if name not in line]
    if missing:
        return LineError("invalid_request", f"missing field(s) {', '.join(missing)}", missing[0], custom_id)
    if line["method"] != "POST":
        return LineError(
            "invalid_request", f"method must be POST, got {line['method']!r}", "method", custom_id
        )
    if line["url"] not in URLS:
        return LineError(
            "invalid_url", f"url must be one of {', '.join(URLS)}, got {line['url']!r}", "url", custom_id
        )
    return BatchRequest(custom_id, line["url"], line["body"])


def response_line(custom_id: str, status: int, body: dict[str, Any]) -> str:
    response = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return _encode({"id": _line_id(), "custom_id": custom_id, "response": response, "error": None})


def error_line(error: LineError) -> str:
    return _encode({"id": _line_id(), "custom_id": error.custom_id, "response": None, "error": error.body()})


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def _encode(line: dict[str, Any]) -> str:
    text = json.dumps(line, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed from the input ("\ud800"): keep it escaped
        text = json.dumps(line, separators=(",", ":"))
    return text
