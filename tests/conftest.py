from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.tiny import make_tiny_model


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
