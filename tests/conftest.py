from __future__ import annotations
from pathlib import Path
from typing import Any, Callable
import pytest
from tandem.engine.tiny import make_tiny_model

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")
    def build(family: str, **overrides: Any) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(root / f"{family}-{len(cache)}", family, **overrides)
        return cache[key]
    return build
