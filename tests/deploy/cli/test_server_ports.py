"""What keeps two `tandem serve` on one host apart: ports of their own (never Ray's fixed ones), the
listener that answers `loading` on the HTTP port from the start, and the one-node log filter."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.deploy.cli import local_ray
from tandem.deploy.cli.server_ports import LoadingListener
from tandem.deploy.config.args import AppArgs
from tandem.deploy.routing import ingress_mode


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_each_server_gets_fallback_proxy_ports_of_its_own(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(ingress_mode, "haproxy_binary", lambda: "/bin/true")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ingress_mode.haproxy_wrapper_environment(str(tmp_path / "a"), "127.0.0.1")
    second = ingress_mode.haproxy_wrapper_environment(str(tmp_path / "b"), "127.0.0.1")
    for key in ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"):
        assert int(first[key]) not in (8500, 9500) and first[key] != second[key]
    # HAProxy binds as Serve's proxy does, beside the listener that answers while loading.
    assert first["SERVE_SOCKET_REUSE_PORT_ENABLED"] == "1"


def test_the_port_answers_loading_until_the_listener_closes() -> None:
    port = _free_port()
    listener = LoadingListener("127.0.0.1", port)
    try:
        for path in ("/health", "/v1/models"):
            reply = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "loading"
        # Serve's proxy and HAProxy (SO_REUSEPORT) bind the port beside it.
        with socket.socket() as serve_listener:
            serve_listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            serve_listener.bind(("127.0.0.1", port))
    finally:
        listener.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_a_taken_port_is_refused_before_anything_starts(monkeypatch: Any) -> None:
    started: list[str] = []
    monkeypatch.setattr(local_ray, "LoadingListener", lambda *a: started.append("listener"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(local_ray.PortTaken, match=r"cannot serve on 127\.0\.0\.1"):
            local_ray.start_local("127.0.0.1", port, AppArgs(), None, "auto", "WARNING")
    assert started == []


def test_one_node_noise_is_left_out_of_the_driver_output(monkeypatch: Any) -> None:
    from ray._private.ray_logging import WorkerStandardStreamDispatcher

    dispatcher = WorkerStandardStreamDispatcher()
    printed: list[list[str]] = []
    dispatcher.add_handler("ray_print_logs", lambda data: printed.append(data["lines"]))
    monkeypatch.setattr("ray._private.ray_logging.global_worker_stdstream_dispatcher", dispatcher)
    local_ray.drop_worker_log_lines("cross-node routing will fail")
    noise = "HTTPOptions.host='127.0.0.1' won't accept connections ...; cross-node routing will fail ..."
    dispatcher.emit({"lines": [noise, "a real warning"]})
    dispatcher.emit({"lines": [noise]})
    assert printed == [["a real warning"]]


def test_the_listener_dies_with_the_command_however_it_ends() -> None:
    import subprocess
    import sys
    import time

    port = _free_port()
    code = (
        "import os; from tandem.deploy.cli.server_ports import LoadingListener; "
        f"LoadingListener('127.0.0.1', {port}); print('up', flush=True); os._exit(9)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "up", done.stderr
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # its stdin closed with the command: the child exits
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        except httpx.TransportError:
            return
        time.sleep(0.2)
    raise AssertionError("the loading listener outlived the command that started it")
