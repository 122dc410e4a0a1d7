"""A normal (non-editable) install ships every subpackage and data file, and imports."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_has_every_package_and_data_file(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    wheel = next(tmp_path.glob("tandem-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "tandem/__init__.py",
        "tandem/llm.py",
        "tandem/engine/engine.py",
        "tandem/engine/models/gemma3.py",
        "tandem/engine/tiny/corpus.txt",
        "tandem/engine/tiny/chat_template.jinja",
        "tandem/engine/tiny/demo/config.json",
        "tandem/engine/tiny/demo/model.safetensors",
        "tandem/engine/tiny/demo/tokenizer.json",
        "tandem/scheduler/scheduler.py",
        "tandem/replicas/llm_replica.py",
        "tandem/cluster/placement.py",
        "tandem/deploy/config/args.py",
    ):
        assert required in names, required
    outside = ("tandem/tests/", "tests/", "tandem/benchmarks/", "tandem/scripts/")
    assert not any(n.startswith(outside) for n in names)

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
    )
    code = (
        "import tandem, tandem.engine.tiny as t; from tandem import LLM, SamplingParams;"
        "from transformers import AutoTokenizer;"
        "print(tandem.__file__); print(len(t.load_tiny_tokenizer()));"
        "print(t.default_model_dir()); print(len(AutoTokenizer.from_pretrained(t.default_model_dir())))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
    )
    file_line, vocab_line, demo_line, demo_vocab_line = out.stdout.split()
    assert file_line.startswith(str(target))
    assert int(vocab_line) == 512
    assert demo_line.startswith(str(target))  # the demo model is served from the installed package
    assert int(demo_vocab_line) == 1024
