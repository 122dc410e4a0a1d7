"""Issue 5: `tandem serve` with no arguments serves the embedded tiny model on CPU (the README's first
command). It runs as a real subprocess that starts its own Ray instance."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
from pathlib import Path

import openai

from tandem.deploy.cli import DEFAULT_METRICS_PORT, DEFAULT_PORT

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


def test_tandem_serve_without_arguments_answers_a_chat_request(tmp_path: Path) -> None:
    command = ["tandem", "serve"]
    if not (_is_free(DEFAULT_PORT) and _is_free(DEFAULT_METRICS_PORT)):
        # Something else holds the defaults on this machine; only then pass ports.
        command += ["--port", str(_free_port()), "--metrics-port", str(_free_port())]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a fresh local Ray
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "serving" in line:
                ready.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    try:
        assert ready.wait(STARTUP_TIMEOUT_S), f"no URL printed; stderr:\n{stderr_path.read_text()[-3000:]}"
        match = re.search(r"(http://\S+/v1)", "".join(lines))
        assert match is not None, lines
        client = openai.OpenAI(base_url=match.group(1), api_key="unused", timeout=60, max_retries=0)
        reply = client.chat.completions.create(
            model="tandem-tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
        assert "loading 'tandem-tiny'" in stderr_path.read_text()  # progress while the model loads
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, stderr_path.read_text()[-3000:]
