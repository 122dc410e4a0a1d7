"""`GET /metrics` on the API port: tandem's families of the node's Ray exporter, open without a key."""

from __future__ import annotations

import asyncio

import httpx

from tandem.deploy.guards.auth import ApiKeys
from tandem.deploy.observability.exposition import tandem_families
from tandem.deploy.serving.http import build_http_app

from ..fakes import make_service

RAY_EXPOSITION = """# HELP ray_tandem_prompt_tokens_total Prompt tokens admitted.
# TYPE ray_tandem_prompt_tokens_total counter
ray_tandem_prompt_tokens_total{model_name="m",WorkerId="w"} 42.0
# HELP ray_node_cpu_utilization CPU
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{ip="1"} 3.0
ray_tandem_time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0
"""


def test_tandem_families_only() -> None:
    text = tandem_families(RAY_EXPOSITION)
    assert "ray_tandem_prompt_tokens_total{" in text
    assert "# TYPE ray_tandem_prompt_tokens_total counter" in text
    assert "ray_tandem_time_to_first_token_seconds_bucket" in text and "cpu" not in text


def test_metrics_route_is_on_the_api_port_and_open() -> None:
    service, _ = make_service()

    async def scrape() -> str:
        return tandem_families(RAY_EXPOSITION)

    async def gone() -> str:
        raise OSError("connection refused")

    async def get(metrics: object) -> httpx.Response:
        app = build_http_app(service, ApiKeys(["secret"]), metrics=metrics)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/metrics")

    response = asyncio.run(get(scrape))
    assert response.status_code == 200  # no key needed, as for /health: scrapers carry none
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "ray_tandem_prompt_tokens_total" in response.text and "cpu" not in response.text
    failed = asyncio.run(get(gone))
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "service_unavailable"
