"""SIGTERM to a `tandem serve` that started its own Ray: new requests get 503, open streams end with
`[DONE]` (finished, or after an error event once the grace period is over), the command exits 0, and
none of the processes it started is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 240.0
GRACE_S = 4.0
STREAMS = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


async def _stream(
    client: httpx.AsyncClient, i: int, first: asyncio.Event, counts: list[int]
) -> dict[str, Any]:
    body = {"prompt": f"drain {i}", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    outcome: dict[str, Any] = {"done": False, "error": None, "finish": None}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                outcome["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    outcome["error"] = chunk["error"]
                else:
                    counts[i] += 1
                    if all(counts):
                        first.set()
                    reason = chunk["choices"][0].get("finish_reason")
                    outcome["finish"] = reason or outcome["finish"]
    return outcome


def test_sigterm_drains_streams_and_leaves_nothing_behind(tmp_path: Path) -> None:
    port, metrics = _free_port(), _free_port()
    command = [sys.executable, "-m", "tandem.deploy.cli.main", "serve", "--port", str(port)]
    command += ["--metrics-port", str(metrics), "--drain-timeout", str(GRACE_S)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    ready = threading.Event()

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if "serving" in line:
                ready.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    started: set[int] = set()
    try:
        assert ready.wait(STARTUP_TIMEOUT_S), stderr_path.read_text()[-3000:]

        async def run() -> tuple[list[dict[str, Any]], int, dict[str, Any], float]:
            first = asyncio.Event()
            counts = [0] * STREAMS
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
                streams = [asyncio.create_task(_stream(client, i, first, counts)) for i in range(STREAMS)]
                await asyncio.wait_for(first.wait(), 60)
                started.update(_descendants(process.pid))
                process.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(1.0)  # within the grace period: the replica is draining
                late = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})
                outcomes = await asyncio.gather(*streams)
                return outcomes, late.status_code, late.json(), time.monotonic() - sent

        outcomes, late_status, late_body, seconds = asyncio.run(run())
        assert late_status == 503 and late_body["error"]["code"] == "shutting_down", late_body
        for outcome in outcomes:
            assert outcome["done"], outcome  # every stream ends with [DONE], none is cut
            assert outcome["error"] is not None or outcome["finish"] == "length", outcome
        assert any(o["error"] is not None for o in outcomes)  # 1900 tokens outlast a 4 s grace on CPU
        assert seconds < GRACE_S + 15.0, seconds
        process.wait(timeout=60)
        assert process.returncode == 0, stderr_path.read_text()[-3000:]
        assert "draining" in stderr_path.read_text()
        assert started, "no process of the command was seen"
        deadline = time.monotonic() + 15.0
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in _alive(started)}
        assert not left, left
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        for pid in _alive(started):
            os.kill(pid, signal.SIGKILL)
