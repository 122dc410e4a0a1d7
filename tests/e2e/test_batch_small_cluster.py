"""`tandem.batch` on a small machine: the README's example runs as written (with the test's tiny model)
on this 2-core box, where Ray is started by the processor itself; a pool that a fixed cluster can never
hold fails at once, naming what it needs and what the cluster has, rather than waiting forever. Each
runs in its own process, with its own Ray instance."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def _readme_batch_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    (snippet,) = [b for b in blocks if "build_processor" in b]
    return snippet


def _run(code: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # no cluster to join
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout_s
    )


def test_the_readme_batch_example_runs_as_written_on_a_small_machine(
    tiny_model_dir: Callable[..., Path],
) -> None:
    snippet = _readme_batch_snippet()
    assert "ray.init" not in snippet and "concurrency=4" in snippet  # as a reader would run it
    model = str(tiny_model_dir("qwen3"))
    (name,) = set(re.findall(r'model_source="([^"]+)"', snippet))
    done = _run(snippet.replace(name, model), timeout_s=600)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = [line for line in done.stdout.splitlines() if " -> " in line]
    questions = re.findall(r'"(What [^"]+\?)"', snippet)
    assert questions and sorted(a.split(" -> ")[0] for a in answers) == sorted(questions), done.stdout


def test_a_pool_a_fixed_cluster_cannot_hold_fails_within_a_minute(
    tiny_model_dir: Callable[..., Path],
) -> None:
    code = f"""
import ray
from tandem.batch import ProcessorConfig, build_processor
from tandem.deploy.batch.actor_pool import PoolCannotBePlaced

ray.init(num_cpus=2, include_dashboard=False)
config = ProcessorConfig(model_source={str(tiny_model_dir("qwen3"))!r}, concurrency=4, device="cpu")
try:
    build_processor(config)(ray.data.from_items([{{"prompt": "x"}}])).take_all()
except PoolCannotBePlaced as exc:
    print("REFUSED", exc)
"""
    started = time.monotonic()
    done = _run(code, timeout_s=90)
    assert time.monotonic() - started < 60.0
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout
    assert "REFUSED" in message, (message, done.stderr[-3000:])
    # What it needs (4 rank CPUs, the actors' slivers and a CPU for Ray Data) and what the cluster has.
    assert re.search(r"need 6 CPU; the cluster has CPU: [\d.]+/2 free", message), message
    assert "no autoscaler" in message
