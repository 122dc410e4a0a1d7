"""The HAProxy configuration tandem serves with: Ray's own template, rendered by Ray, then rewritten by
haproxy_filter.py; checked by the HAProxy binary Ray ships (`haproxy -c`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tandem.deploy.routing import haproxy_filter
from tandem.deploy.routing.ingress_mode import haproxy_binary, haproxy_wrapper_environment


def _ray_config(tmp_path: Path, host: str) -> str:
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    http = HTTPOptions(host=host, port=8123)
    cfg = HAProxyConfig(http_options=http, socket_path=str(tmp_path / "admin.sock"))
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    api._generate_config_file_internal()
    return (tmp_path / "haproxy.cfg").read_text()


def test_unused_listeners_go_and_every_bind_is_on_the_host(tmp_path: Path) -> None:
    original = _ray_config(tmp_path, "127.0.0.1")
    assert "listen stats" in original and "frontend prometheus" in original  # what Ray writes
    rewritten = haproxy_filter.rewrite(original, "127.0.0.1")
    assert "listen stats" not in rewritten and "frontend prometheus" not in rewritten
    binds = [line.split()[1] for line in rewritten.splitlines() if line.strip().startswith("bind ")]
    assert binds == ["127.0.0.1:8123"]
    assert haproxy_filter.LOADING_BODY in rewritten  # /health before the app's route exists
    binary = haproxy_binary()
    if binary is None:
        pytest.skip("no HAProxy binary")
    (tmp_path / "haproxy.cfg").write_text(rewritten)
    check = subprocess.run(
        [binary, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_bind_on_every_interface_moves_to_the_host() -> None:
    config = "frontend x\n    bind :9101\n    bind *:8404 ssl\nlisten other\n  bind 0.0.0.0:1\n"
    assert haproxy_filter.rewrite(config, "10.0.0.5").split("\n") == [
        "frontend x", "    bind 10.0.0.5:9101", "    bind 10.0.0.5:8404 ssl", "listen other",
        "  bind 10.0.0.5:1", "",
    ]  # fmt: skip
    assert haproxy_filter.rewrite(config, "0.0.0.0") == config  # the user asked for every interface


def test_the_wrapper_rewrites_then_runs_the_real_binary(tmp_path: Path) -> None:
    if haproxy_binary() is None:
        pytest.skip("no HAProxy binary")
    env = haproxy_wrapper_environment(str(tmp_path), "127.0.0.1")
    wrapper = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    config = tmp_path / "haproxy.cfg"
    config.write_text(_ray_config(tmp_path, "127.0.0.1"))
    done = subprocess.run([wrapper, "-c", "-f", str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "listen stats" not in config.read_text()
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] != "8404"
