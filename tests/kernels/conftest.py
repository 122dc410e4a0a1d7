"""Fixtures of the kernel tests: a runner for Triton kernels in Triton's CPU interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def triton_interpreter() -> Callable[[str, object], Any]:
    """`run(script, arg)`: run `script` with json(arg) as argv[1] under TRITON_INTERPRET=1 and return the
    JSON its last output line holds. Skips without Triton (CI: CPU torch does not bring it). A process
    of its own, because the interpreter patches triton.language globally when a kernel is decorated."""
    pytest.importorskip("triton")

    def run(script: str, arg: object) -> Any:
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps(arg)],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
