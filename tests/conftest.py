"""Fixtures for every test layer: `tiny_model_dir` (random-weight tiny HF models, built once per session)
and the soak's request-count option."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.tiny import make_tiny_model

# Enabled before pytest's own faulthandler plugin configures, so that the plugin restores it at
# unconfigure: a crash while the interpreter exits (after the summary) then prints every thread's stack
# instead of a bare "Segmentation fault".
faulthandler.enable(all_threads=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave nothing running into interpreter exit: shut down a Ray driver a test left connected, and
    name the threads still alive, so that a crash at exit can be tied to what was still running."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        print(f"\nthreads alive at the end of the session: {', '.join(sorted(alive))}", file=sys.stderr)


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
