"""Fixtures for every test layer: `tiny_model_dir` (random-weight tiny HF models, built once per session)
and the soak's request-count option."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.tiny import make_tiny_model


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here rather than in tests/e2e/conftest.py: pytest only takes options from conftests it loads at
    # start-up, and a plain `pytest` (testpaths = tests) does not load tests/e2e/conftest.py that early.
    parser.addoption(
        "--soak-requests",
        type=int,
        default=int(os.environ.get("TANDEM_SOAK_REQUESTS", "1000")),
        help="Requests in the e2e soak (tests/e2e/test_soak.py): 1000 in CI, 10000 for the long form. "
        "Also read from TANDEM_SOAK_REQUESTS.",
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_model_dir(family, **overrides) -> Path`: a tiny HF model dir, built once per session per
    (family, overrides). `seed=` may be passed among the overrides. Treat the dirs as read-only."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def build(family: str, **overrides: Any) -> Path:
        # JSON (not hash()) so dict-valued overrides such as rope_scaling work as cache keys.
        key = json.dumps([family, overrides], sort_keys=True, default=repr)
        if key not in built:
            built[key] = make_tiny_model(root / f"{family}-{len(built)}", family, **overrides)
        return built[key]

    return build
