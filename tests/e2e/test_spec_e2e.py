"""Speculative decoding on a real Ray Serve app (CPU): `engine.speculative_config` from the serve config,
the per-request `speculative: false` body field (same greedy text, a 400 for a non-boolean), and the
spec-decode counters, per position too, on the metrics port."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tandem.deploy.observability.metrics import EXPORTED_PREFIX
from tandem.deploy.observability.spec_metrics import SPEC_METRIC_NAMES
from tandem.engine.tiny import default_model_dir

# The demo model recites its training text: a passage, then its start again, makes the drafts hit.
CORPUS = (default_model_dir().parent / "corpus.txt").read_text()
PROMPT = CORPUS[:300] + CORPUS[:60]


@pytest.fixture(scope="module")
def app(serve_app_context) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    args = {
        "model": str(default_model_dir()),
        "served_model_name": "tiny-spec",
        "device": "cpu",
        "engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        "max_ongoing_requests": 8,
    }
    with serve_app_context(args) as running:
        yield running


def test_switch_and_metrics(app: Any) -> None:
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=60, max_retries=0)

    def complete(**extra: Any) -> str:
        out = client.completions.create(
            model=app.served_model_name, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra
        )
        return out.choices[0].text

    drafted = complete()
    assert complete(speculative=False) == drafted
    with pytest.raises(openai.BadRequestError) as bad:
        complete(speculative="sometimes")
    assert "speculative" in str(bad.value)
    wanted = {EXPORTED_PREFIX + name for name in SPEC_METRIC_NAMES}
    deadline, missing, text = time.monotonic() + 30.0, wanted, ""
    while missing and time.monotonic() < deadline:
        url = f"http://127.0.0.1:{app.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        missing = {name for name in wanted if f"\n{name}" not in text}
        if missing:
            time.sleep(1.0)
    assert not missing, f"not exported: {sorted(missing)}"
    assert 'position="0"' in text
