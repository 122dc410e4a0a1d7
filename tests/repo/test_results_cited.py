"""Every file kept in benchmarks/results is cited by the README or docs/benchmarks.md, so none is an
orphan, and the benchmarks folder stays within its size budget."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# 60, plus the MoE, LoRA and batch benchmarks, the MoE and LoRA one-token launch sweeps behind their
# kernels' defaults, and their H200 result files; and the gpt-oss, low-bit and speculative-decoding
# benchmarks (their result files raise this as they land); the MXFP4 expert kernels' benchmark.
MAX_BENCHMARK_FILES = 75


def test_every_result_file_is_cited() -> None:
    cited = (ROOT / "README.md").read_text(encoding="utf-8") + (ROOT / "docs" / "benchmarks.md").read_text(
        encoding="utf-8"
    )
    orphans = [f.name for f in sorted(RESULTS.iterdir()) if f.is_file() and f"results/{f.name}" not in cited]
    assert not orphans, f"cite these in README.md or docs/benchmarks.md, or delete them: {orphans}"


def test_benchmarks_stay_small() -> None:
    files = [f for f in (ROOT / "benchmarks").rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    assert len(files) <= MAX_BENCHMARK_FILES, len(files)
