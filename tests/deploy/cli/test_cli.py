"""The `tandem` command line: parsing, config files, overrides and progress output."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tandem.deploy.cli.defaults import DEFAULT_PORT
from tandem.deploy.cli.main import build_parser, main, tandem_version
from tandem.deploy.cli.serve_command import command_started_at, plan_from_cli, wait_until_running
from tandem.deploy.config.args import TINY_MODEL_NAME


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_no_arguments_serves_the_tiny_model_on_cpu_port_8000() -> None:
    args = _serve()
    assert args.metrics_port is None  # a free port of the server's own, not a fixed one
    plan = plan_from_cli(args)
    assert plan.app_args.model is None and plan.app_args.resolved_served_model_name() == TINY_MODEL_NAME
    assert (plan.host, plan.port, plan.name, plan.route_prefix) == ("127.0.0.1", DEFAULT_PORT, "tandem", "/")


def test_version_and_log_level(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"tandem {tandem_version()}"
    assert tandem_version() != "unknown"
    assert _serve().log_level == "warning"  # quiet by default: Ray's and Serve's INFO lines hidden
    assert _serve("--log-level", "debug").log_level == "debug"
    with pytest.raises(SystemExit):
        _serve("--log-level", "loud")


def test_flags() -> None:
    plan = plan_from_cli(
        _serve("--model", "Qwen/Qwen3-8B", "--tp", "2", "--device", "cuda", "--port", "9000")
    )
    assert (plan.app_args.model, plan.app_args.tp_size, plan.app_args.device) == ("Qwen/Qwen3-8B", 2, "cuda")
    assert plan.port == 9000
    for bad in (["--tp", "0"], ["--port", "70000"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            _serve(*bad)


def test_serve_config_file_then_flags_override(tmp_path: Path) -> None:
    config = {
        "http_options": {"host": "0.0.0.0", "port": 8500},
        "applications": [
            {"name": "other", "import_path": "somewhere:else", "args": {}},
            {
                "name": "llm",
                "route_prefix": "/llm",
                "import_path": "tandem.deploy.app:build_app",
                "args": {"model": "m", "tp_size": 4, "max_ongoing_requests": 8},
            },
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = plan_from_cli(_serve("--config", str(path)))
    assert (plan.name, plan.route_prefix, plan.host, plan.port) == ("llm", "/llm", "0.0.0.0", 8500)
    assert (plan.app_args.model, plan.app_args.tp_size, plan.app_args.max_ongoing_requests) == ("m", 4, 8)
    overridden = plan_from_cli(_serve("--config", str(path), "--tp", "2", "--port", "9001"))
    assert (overridden.app_args.tp_size, overridden.port) == (2, 9001)
    with pytest.raises(SystemExit):
        plan_from_cli(_serve("--config", str(path), "--name", "missing"))


def test_bare_args_file(tmp_path: Path) -> None:
    path = tmp_path / "args.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "engine": {"page_size": 16}}))
    plan = plan_from_cli(_serve("--config", str(path)))
    assert plan.app_args.engine.page_size == 16 and plan.name == "tandem"
    path.write_text(yaml.safe_dump({"model": "m", "tp": 2}))  # a typo is named, not ignored
    with pytest.raises(Exception, match="tp"):
        plan_from_cli(_serve("--config", str(path)))


@pytest.mark.parametrize("kind", ["offline", "online", "decode", "window", "moe"])
def test_bench_subcommands_reach_the_benchmark(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", kind, "--help"])
    assert exit_info.value.code == 0
    assert f"tandem bench {kind}" in capsys.readouterr().out  # the benchmark's own parser answered
    with pytest.raises(SystemExit):
        main(["bench", "sideways"])


def test_progress_is_printed_until_running(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray import serve

    deploying = SimpleNamespace(
        status="DEPLOYING",
        message="",
        deployments={"LLMServer": SimpleNamespace(status="UPDATING", replica_states={"STARTING": 1})},
    )
    running = SimpleNamespace(status="RUNNING", message="", deployments={})
    states: list[Any] = [None, deploying, running]
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"app": states.pop(0)}))
    monkeypatch.setattr("time.sleep", lambda s: None)
    out = io.StringIO()
    import time

    assert wait_until_running("app", "tiny", out, since=time.time() - 7.2)
    text = out.getvalue()
    assert "loading 'tiny': submitting" in text and "LLMServer updating (1 starting)" in text
    # Counted from the command's start (here 7 s before), not from when the deploy began.
    assert "'tiny' is ready after 7s (from the command's start)" in text
    assert command_started_at() <= time.time()
    failed = SimpleNamespace(status="DEPLOY_FAILED", message="out of GPUs", deployments={})
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"app": failed}))
    out = io.StringIO()
    assert not wait_until_running("app", "tiny", out)
    assert "out of GPUs" in out.getvalue()


def test_ingress_modes_set_the_ray_environment() -> None:
    from tandem.deploy.routing.ingress_mode import HAPROXY_ENV, ray_environment
    from tandem.deploy.routing.proxy_errors import PROXY_CALLBACK_ENV

    assert build_parser().parse_args(["serve"]).ingress == "auto"
    assert build_parser().parse_args(["serve", "--ingress", "haproxy"]).ingress == "haproxy"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ingress", "nginx"])
    proxy, haproxy = ray_environment("proxy"), ray_environment("haproxy")
    assert HAPROXY_ENV not in proxy and haproxy[HAPROXY_ENV] == "1"
    assert PROXY_CALLBACK_ENV in proxy and PROXY_CALLBACK_ENV in haproxy  # the proxy stays as a fallback
    with pytest.raises(ValueError, match="ingress must be one of"):
        ray_environment("nginx")
    # HAProxy's files go to the server's own directory, never Ray's shared /tmp/haproxy-serve.
    private = ray_environment("haproxy", "/run/x")
    assert private["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] == "/run/x/haproxy.cfg"
    assert all(v.startswith("/run/x") for k, v in private.items() if k.startswith("RAY_SERVE_HAPROXY_"))


def test_auto_ingress_takes_haproxy_only_when_ray_finds_its_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.deploy.routing import ingress_mode

    monkeypatch.setattr(ingress_mode, "haproxy_binary", lambda: "/opt/haproxy")
    assert ingress_mode.resolve_ingress("auto")[0] == "haproxy"
    assert ingress_mode.resolve_ingress("proxy")[0] == "proxy"
    monkeypatch.setattr(ingress_mode, "haproxy_binary", lambda: None)
    assert ingress_mode.resolve_ingress("auto") == ("proxy", "no HAProxy binary found")
    # On this machine, whatever Ray would run is what `auto` reports.
    monkeypatch.undo()
    found = ingress_mode.haproxy_binary()
    assert ingress_mode.resolve_ingress("auto")[0] == ("haproxy" if found else "proxy")


def test_a_taken_port_is_named_with_its_holder() -> None:
    import socket

    from tandem.deploy.cli.processes import port_holder

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        holder = port_holder("127.0.0.1", port)
        assert holder is not None and "in use" in holder.lower()
    assert port_holder("127.0.0.1", port) is None


def test_processes_naming_the_servers_directory_are_stopped(tmp_path: Any) -> None:
    """What `tandem serve` does for an HAProxy spawned by a reload during shutdown, after its snapshot."""
    import subprocess
    import sys

    import psutil

    from tandem.deploy.cli.processes import stop_processes_naming

    marker = str(tmp_path / "tandem-marker")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        killed = stop_processes_naming(marker, settle_s=3.0)
        assert killed and f"pid {child.pid}" in killed[0]
        assert not psutil.pid_exists(child.pid)  # killed (and reaped), not left to sleep
        assert stop_processes_naming(marker, settle_s=1.5) == []
    finally:
        if child.poll() is None:
            child.kill()


def test_engine_flags_override_the_config_engine_block(tmp_path: Path) -> None:
    path = tmp_path / "args.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "tp_size": 2, "engine": {"page_size": 16}}))
    plan = plan_from_cli(_serve("--config", str(path), "--enable-expert-parallel", "--load-format", "dummy"))
    engine = plan.app_args.engine
    assert (engine.enable_expert_parallel, engine.load_format, engine.page_size) == (True, "dummy", 16)
    assert engine.to_llm_kwargs() == {"page_size": 16, "enable_expert_parallel": True, "load_format": "dummy"}
    plain = plan_from_cli(_serve("--config", str(path))).app_args.engine
    assert (plain.enable_expert_parallel, plain.load_format) == (False, "auto")
    assert "enable_expert_parallel" not in plain.to_llm_kwargs()  # unset flags leave the config alone
    with pytest.raises(SystemExit):
        _serve("--load-format", "pt")
