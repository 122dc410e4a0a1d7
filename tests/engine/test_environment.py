"""The one module that reads the environment."""

from __future__ import annotations

import pytest

from tandem.engine.environment import ray_address


def test_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address() == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert ray_address() is None  # empty means unset, as for `ray.init`
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address() is None
