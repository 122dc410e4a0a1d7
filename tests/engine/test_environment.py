"""The one module that reads the environment."""

from __future__ import annotations

import pytest

from tandem.engine.environment import api_keys_from_env, ray_address, serve_host


def test_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address() == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert ray_address() is None  # empty means unset, as for `ray.init`
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address() is None


def test_api_keys_and_serve_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", " sk-a ,,sk-b")
    assert api_keys_from_env() == ["sk-a", "sk-b"]
    monkeypatch.delenv("TANDEM_API_KEY")
    assert api_keys_from_env() == []
    monkeypatch.setenv("TANDEM_HOST", "0.0.0.0")
    assert serve_host() == "0.0.0.0"
    monkeypatch.setenv("TANDEM_HOST", "")
    assert serve_host() is None
