"""A vLLM user's `vllm serve` command line, run as `tandem serve`: a real subprocess that starts its own
Ray instance, serving a tiny model with vLLM's flags, checked through the OpenAI SDK."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai

STARTUP_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_vllm_command_line_serves(tmp_path: Path, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model = str(tiny_model_dir("qwen3"))
    command = [sys.executable, "-m", "tandem.deploy.cli", "serve", model, "--port", str(_free_port())]
    command += ["--tensor-parallel-size", "1", "--max-model-len", "128", "--dtype", "float32"]
    command += ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--no-enable-prefix-caching"]
    command += ["--seed", "3", "--served-model-name", "tiny-vllm", "--enable-auto-tool-choice"]
    command += ["--tool-call-parser", "hermes", "--disable-log-requests", "--device", "cpu"]
    command += ["--allowed-origins", '["https://ui.example"]']
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
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
        assert ready.wait(STARTUP_TIMEOUT_S), f"not serving; stderr:\n{stderr_path.read_text()[-3000:]}"
        match = re.search(r"(http://\S+/v1)", "".join(lines))
        assert match is not None, lines
        url = match.group(1)
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
        card = client.models.retrieve("tiny-vllm")
        assert card.model_dump()["max_model_len"] == 128  # --max-model-len reached the engine
        out = client.completions.create(model="tiny-vllm", prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 4
        with_origin = httpx.get(f"{url}/models", headers={"Origin": "https://ui.example"})
        assert with_origin.headers["access-control-allow-origin"] == "https://ui.example"
        too_long = httpx.post(f"{url}/completions", json={"prompt": [1] * 130, "max_tokens": 1})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
