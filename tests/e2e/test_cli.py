"""`tandem serve` with no arguments serves the demo model on CPU (the README's first command);
with HAProxy it leaves nothing behind that could answer for a later server; a taken port is refused at
once. Each run is a real subprocess that starts its own Ray instance."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tandem.deploy.cli.defaults import DEFAULT_PORT
from tandem.deploy.cli.processes import port_holder
from tandem.deploy.routing.ingress_mode import haproxy_binary

STARTUP_TIMEOUT_S = 240.0


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def tandem_serve(extra: list[str], tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Run `tandem serve` + extra as a subprocess; yield (base URL ending in /v1, stderr file)."""
    command = ["tandem", "serve", *extra]
    # Something else may hold the defaults on this machine; only then pass ports.
    if "--port" not in extra and not _is_free(DEFAULT_PORT):
        command += ["--port", str(_free_port())]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a fresh local Ray
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        # Started as a shell starts a background job, with SIGINT ignored: the SIGINT below must still
        # stop it, as Ctrl-C does in a terminal.
        shell = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *command]
        process = subprocess.Popen(shell, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Python handle:" in line:  # the last line printed once it serves
                ready.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    try:
        assert ready.wait(STARTUP_TIMEOUT_S), f"no URL printed; stderr:\n{stderr_path.read_text()[-3000:]}"
        match = re.search(r"(http://\S+/v1)", "".join(lines))
        assert match is not None, lines
        hint = next((line for line in lines if "Python handle:" in line), "")
        os.environ["TANDEM_E2E_LAST_HANDLE_ENV"] = " ".join(re.findall(r"RAY_[A-Z_]+=\S+", hint))
        yield match.group(1), stderr_path
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, stderr_path.read_text()[-3000:]


def test_tandem_serve_without_arguments_answers_a_chat_request(tmp_path: Path) -> None:
    with tandem_serve([], tmp_path) as (url, stderr_path):
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
        reply = client.chat.completions.create(
            model="tandem-tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
        log = stderr_path.read_text()
        assert "loading 'tandem-tiny'" in log  # progress while the model loads
        # Quiet by default (--log-level warning): Ray's, Serve's and HAProxy's INFO lines are not shown.
        assert not [line for line in log.splitlines() if " INFO " in line], log[-3000:]


def _haproxy_pids() -> set[int]:
    pids = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() == "haproxy":
                pids.add(int(comm.parent.name))
    return pids


def _haproxy_running() -> bool:
    return bool(_haproxy_pids())


def test_haproxy_ingress_serves_streams_without_the_python_proxy(tmp_path: Path) -> None:
    """`--ingress haproxy`: Ray's HAProxy on the app port, straight to the replica's own HTTP server.
    Then a proxy-mode server on the same port: the first left nothing behind that could answer for it."""
    before = _haproxy_pids()
    port = str(_free_port())
    with tandem_serve(["--ingress", "haproxy", "--port", port], tmp_path) as (url, _):
        assert _haproxy_pids() - before
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
        stream = client.completions.create(
            model="tandem-tiny", prompt="The fox", max_tokens=12, stream=True, temperature=0
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        whole = client.completions.create(model="tandem-tiny", prompt="The fox", max_tokens=12, temperature=0)
        assert text == whole.choices[0].text  # streamed and not, through HAProxy, agree
        # Errors keep the OpenAI shape: the app, not the Python proxy, writes them.
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        assert isinstance(caught.value.body, dict) and "message" in caught.value.body
    assert not (_haproxy_pids() - before)  # no HAProxy outlives its server, to keep the port
    # Free to a server (which, like this check, binds past the old connections' TIME_WAIT).
    assert port_holder("127.0.0.1", int(port)) is None
    with tandem_serve(["--ingress", "proxy", "--port", port], tmp_path) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
        reply = client.completions.create(model="tandem-tiny", prompt="The fox", max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_taken_port_is_refused_at_once(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        session = Path(tempfile.gettempdir(), "ray", "session_latest")
        session_before = session.resolve() if session.exists() else None
        started = time.monotonic()
        done = subprocess.run(
            ["tandem", "serve", "--port", str(port)], capture_output=True, text=True, env=env, timeout=60
        )
        took = time.monotonic() - started
    assert done.returncode == 1
    # At once: the imports, and no Ray started (not even to remove an app that never was), as before.
    assert took < 10.0, (took, done.stderr[-2000:])
    assert (session.resolve() if session.exists() else None) == session_before  # no Ray session began
    assert f"cannot serve on 127.0.0.1:{port}" in done.stderr and f"pid {os.getpid()}" in done.stderr
    assert "started a local Ray" not in done.stderr  # said before Ray starts


class HealthProbe(threading.Thread):
    """Polls /health from before the port is bound until it answers 200: (seconds, status, code) of
    every answer, connection refusals left out."""

    def __init__(self, port: int, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/health"
        self.answers: list[tuple[float, int, str | None]] = []
        self.deadline = time.monotonic() + timeout_s

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            started = time.monotonic()
            try:
                response = httpx.get(self.url, timeout=5.0)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
            self.answers.append((time.monotonic() - started, response.status_code, code))
            if response.status_code == 200:
                return
            time.sleep(0.2)


def _readme_handle_script() -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (script,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "get_app_handle" in b]
    return script


def _listeners_of_the_server_on(port: int) -> set[tuple[str, int]]:
    """Every listening socket of the process that listens on `port` (the server's HAProxy)."""
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    (pid,) = {c.pid for c in listening if c.laddr.port == port}
    assert psutil.Process(pid).name() == "haproxy"
    return {(c.laddr.ip, c.laddr.port) for c in listening if c.pid == pid}


def test_two_servers_side_by_side_answer_health_while_loading_and_the_readme_handle(tmp_path: Path) -> None:
    """The default ingress (HAProxy where found): /health answers within a second from the moment the
    port is bound, 503 `loading` then 200; the README's handle example runs as a script beside the
    server; /metrics is on the API port; a second server starts beside the first, and HAProxy listens on
    nothing but the two servers' host and ports."""
    if haproxy_binary() is None:
        pytest.skip("no HAProxy binary: the proxy ingress has no fixed ports to collide on")
    port_a, port_b = _free_port(), _free_port()
    probe = HealthProbe(port_a)
    probe.start()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with tandem_serve(["--port", str(port_a)], tmp_path / "a") as (url_a, stderr_a):
        probe.join(timeout=60)
        answers = probe.answers
        assert answers and answers[-1][1] == 200, answers
        assert [a for a in answers if a[1] == 503 and a[2] == "loading"], answers  # it said so while loading
        assert all(status == 200 or code == "loading" for _, status, code in answers), answers
        assert max(seconds for seconds, _, _ in answers) < 1.0, answers
        assert "(from the command's start)" in stderr_a.read_text()
        script = tmp_path / "handle.py"
        script.write_text(_readme_handle_script())
        # The server's own Ray (other helpers' clusters may run on a shared test host), as its hint says.
        env = dict(os.environ)
        env.update(pair.split("=", 1) for pair in os.environ["TANDEM_E2E_LAST_HANDLE_ENV"].split())
        assert "RAY_ADDRESS" in env
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180
        )
        assert done.returncode == 0 and "'object': 'chat.completion'" in done.stdout, done.stderr[-3000:]
        metrics = httpx.get(f"http://127.0.0.1:{port_a}/metrics", timeout=30)
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        with tandem_serve(["--port", str(port_b)], tmp_path / "b") as (url_b, _):
            for url in (url_a, url_b):
                client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
                reply = client.completions.create(model="tandem-tiny", prompt="The fox", max_tokens=4)
                assert reply.choices[0].finish_reason in ("stop", "length")
            for port in (port_a, port_b):  # no stats page or exporter, nothing beyond the chosen host
                assert _listeners_of_the_server_on(port) == {("127.0.0.1", port)}


class ModelsProbe(threading.Thread):
    """Polls /v1/models on a port until it lists `served`: the model names of every 200 answer, and the
    other answers' (status, code)."""

    def __init__(self, port: int, served: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        super().__init__(daemon=True)
        self.url, self.served = f"http://127.0.0.1:{port}/v1/models", served
        self.listed: list[list[str]] = []
        self.refused: list[tuple[int, str | None]] = []
        self.deadline = time.monotonic() + timeout_s

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                response = httpx.get(self.url, timeout=5.0)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if response.status_code == 200:
                self.listed.append([m["id"] for m in response.json()["data"]])
                if self.served in self.listed[-1]:
                    return
            else:
                with contextlib.suppress(ValueError, AttributeError):
                    self.refused.append((response.status_code, response.json()["error"]["code"]))
            time.sleep(0.2)


def _state_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("tandem-*") if p.is_dir()}


def test_a_second_server_never_answers_with_the_first_servers_app(tmp_path: Path) -> None:
    """Two servers on one host, each its own model name: while the second loads, its port answers only
    `loading` (never the first's app, through a shared fallback proxy or metrics port); both then serve
    their own model; once stopped, neither leaves an HAProxy or its state folder behind."""
    haproxy_before, dirs_before = _haproxy_pids(), _state_dirs()
    port_a, port_b = _free_port(), _free_port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with tandem_serve(["--port", str(port_a)], tmp_path / "a") as (url_a, stderr_a):
        probe = ModelsProbe(port_b, "other")
        probe.start()
        with tandem_serve(["--port", str(port_b), "--served-model-name", "other"], tmp_path / "b") as (
            url_b,
            _,
        ):
            probe.join(timeout=60)
            assert probe.listed and all(names == ["other"] for names in probe.listed), probe.listed
            assert all(code == "loading" for _, code in probe.refused), probe.refused
            for url, served in ((url_a, "tandem-tiny"), (url_b, "other")):
                client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
                reply = client.completions.create(model=served, prompt="The fox", max_tokens=4)
                assert reply.model == served
                with pytest.raises(openai.NotFoundError):  # each port serves its own model alone
                    client.completions.create(
                        model="other" if served == "tandem-tiny" else "tandem-tiny", prompt="x", max_tokens=1
                    )
    assert not (_haproxy_pids() - haproxy_before)
    assert _state_dirs() <= dirs_before, _state_dirs() - dirs_before
    # Serve's warning about HAProxy on other nodes means nothing to a one-node Ray started here.
    assert "cross-node" not in stderr_a.read_text()
