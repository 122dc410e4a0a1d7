"""A body sent as form data (`curl -d` without a content-type header) gets a 400 that names the content
type, on every JSON route; a JSON body without any content-type header still parses."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tandem.deploy.serving.http import build_http_app

from ..fakes import FakeReplica, make_service

BODY = json.dumps({"prompt": "SELECT", "max_tokens": 4})


def _post(path: str, headers: dict[str, str]) -> httpx.Response:
    service, _ = make_service(FakeReplica(max_model_len=256))
    app: Any = build_http_app(service)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=BODY, headers=headers)

    return asyncio.run(go())


def test_form_data_gets_a_400_naming_the_content_type() -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"):
        response = _post(path, form)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "application/x-www-form-urlencoded" in error["message"]
        assert "content-type: application/json" in error["message"]
        assert error["param"] == "content-type"


def test_a_json_body_with_the_header_still_works() -> None:
    response = _post("/v1/completions", {"content-type": "application/json"})
    assert response.status_code == 200, response.text
