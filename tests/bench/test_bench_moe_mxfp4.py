"""benchmarks/kernels/moe_mxfp4.py: the bytes its floors count, worked by hand at gpt-oss-20b's expert
shape, and the whole script on CPU (a tiny shape, the kernels in Triton's interpreter), both formats on
both paths, checked against the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.benchmarks.kernels.moe_mxfp4 import GPT_OSS_20B, call_bytes, expert_bytes

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "moe_mxfp4.py"


def test_an_expert_reads_a_quarter_of_its_bf16_bytes_and_a_scale_per_32() -> None:
    values, biases = 3 * 2880 * 2880, (2 * 2880 + 2880) * 2
    assert expert_bytes(GPT_OSS_20B, "mxfp4") == values * 17 / 32 + biases  # 13.2 MB
    assert expert_bytes(GPT_OSS_20B, "dense") == values * 2 + biases  # 49.8 MB


def test_a_call_reads_each_chosen_expert_once() -> None:
    ids = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])  # two tokens, the same four experts
    # x read, 8 pairs' activations written and read, 2 rows written: bf16.
    activations = (2 * 2880 + 2 * 8 * 2880 + 2 * 2880) * 2
    assert call_bytes(GPT_OSS_20B, ids, "mxfp4") == 4 * expert_bytes(GPT_OSS_20B, "mxfp4") + activations
    every = torch.arange(64).view(16, 4) % 32
    assert (
        call_bytes(GPT_OSS_20B, every, "dense")
        == 32 * expert_bytes(GPT_OSS_20B, "dense") + (2 * 16 * 2880 + 2 * 64 * 2880) * 2
    )


def test_the_smoke_run_times_both_formats_on_both_paths(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "moe-mxfp4.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--tokens", "1", "8", "--out", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["benchmark"] == "moe-mxfp4" and record["commit"] and "device" in record
    rows = record["rows"]
    assert [(r["tokens"], r["format"], r["path"]) for r in rows] == [
        (1, "mxfp4", "small"),
        (1, "dense", "small"),
        (8, "mxfp4", "grouped"),
        (8, "dense", "grouped"),
    ]
    bandwidth = record["ceilings"]["copy_bandwidth_GBps"]
    for r in rows:
        assert r["rel_rms"] < 1e-2 and r["us"] > 0, r
        assert r["floor_us"] == pytest.approx(r["bytes"] / (bandwidth * 1e9) * 1e6)
    assert rows[0]["bytes"] < rows[1]["bytes"] / 3  # the same experts, in a quarter of the bytes and scales
    assert set(record["mxfp4_vs_dense"]) == {"1", "8"}
