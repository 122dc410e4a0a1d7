"""benchmarks/lowbit.py: each section's config is the format it names (MXFP4 experts on the gpt-oss-120b
shape, 128 x 128 FP8 blocks on Qwen3-30B-A3B and Llama-3.1-8B), the 120b floor reads the 4 experts of its
token in MXFP4's bytes, and the whole script runs on CPU with tiny shapes, its sections in separate calls
merging into one file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.benchmarks import lowbit
from tandem.benchmarks.gpt_oss import decode_b1_bytes
from tandem.benchmarks.shapes import write_dummy_model
from tandem.engine.config import ModelConfig
from tandem.engine.quant.fp8_format import Fp8Checkpoint
from tandem.engine.quant.mxfp4 import Mxfp4Checkpoint


def test_each_engine_is_the_shape_and_format_it_names(tmp_path: Path) -> None:
    written = {
        key: write_dummy_model(tmp_path / key, m.family, m.shape, quantization=m.quantization)
        for engines in lowbit.sections(tiny=False).values()
        for key, m in engines.items()
    }
    big = ModelConfig.from_dir(written["gpt_oss_120b"])
    assert big.moe is not None and (big.num_layers, big.moe.num_experts, big.moe.top_k) == (36, 128, 4)
    assert Mxfp4Checkpoint.from_dir(written["gpt_oss_120b"]) is not None
    for pair, (layers, hidden) in {"qwen3_moe": (48, 2048), "llama": (32, 4096)}.items():
        fp8, bf16 = (
            Fp8Checkpoint.from_dir(written[f"{pair}_fp8"]),
            Fp8Checkpoint.from_dir(written[f"{pair}_bf16"]),
        )
        assert fp8 is not None and fp8.block == (128, 128) and bf16 is None
        c = ModelConfig.from_dir(written[f"{pair}_fp8"])
        assert (c.num_layers, c.hidden_size) == (layers, hidden)
        assert c == ModelConfig.from_dir(written[f"{pair}_bf16"])  # the same shape both ways


def test_the_120b_floor_reads_four_experts_in_mxfp4(tmp_path: Path) -> None:
    m = lowbit.sections(tiny=False)["gpt_oss_120b"]["gpt_oss_120b"]
    c = ModelConfig.from_dir(
        write_dummy_model(tmp_path / "m", m.family, m.shape, quantization=m.quantization)
    )
    parts = decode_b1_bytes(c, 512, expert_elem=0.5 + 1 / 32)
    # 4 of 128 experts a layer: gate/up/down at half a byte a value plus a byte of scale per 32, and their
    # bf16 biases.
    assert parts["routed_experts"] == 36 * 4 * (3 * 2880 * 2880 * 17 / 32 + 3 * 2880 * 2)
    assert parts["router"] == 36 * 128 * 2881 * 2
    assert parts["lm_head"] == 201088 * 2880 * 2
    assert parts["kv"] == (18 * 128 + 18 * 512) * 2 * 8 * 64 * 2
    assert 4.9e9 < parts["total"] < 5.1e9  # of a 65 GB model


SMALL = ["--tiny", "--device", "cpu", "--num-seqs", "2", "--min-input", "8", "--max-input", "16"]
SMALL += ["--min-output", "4", "--max-output", "8", "--steps", "1"]


def test_the_sections_run_and_merge_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "lowbit.json"
    common = [*SMALL, "--out", str(out), "--model-root", str(tmp_path / "models")]
    lowbit.main([*common, "--only", "llama"])
    first = json.loads(out.read_text())
    assert set(first["runs"]) == {"llama"} and "gpt_oss_120b" not in first
    lowbit.main([*common, "--only", "gpt_oss_120b,qwen3_moe"])
    record = json.loads(out.read_text())
    assert set(record["runs"]) == set(record["ceilings"]) == {"gpt_oss_120b", "qwen3_moe", "llama"}
    assert (
        record["runs"]["llama"] == first["runs"]["llama"]
        and first["runs"]["llama"]["workload"]["num_seqs"] == 2
    )
    assert record["llama_bf16"] == first["llama_bf16"]  # kept from the first call
    big = record["gpt_oss_120b"]
    assert big["weights_gib"] > 0 and big["offline_tok_s"] > 0 and big["decode_b1_ms"] > 0
    assert big["decode_b1_floor_ms"] == pytest.approx(
        big["decode_b1_floor_bytes"]["total"] / (big["copy_bandwidth_GBps"] * 1e9) * 1e3
    )
    for pair in ("qwen3_moe", "llama"):
        fp8, bf16 = record[f"{pair}_fp8"], record[f"{pair}_bf16"]
        assert (
            fp8["quantization_config"]["weight_block_size"] == [128, 128]
            and bf16["quantization_config"] is None
        )
        ratio = record[f"{pair}_fp8_over_bf16"]
        assert ratio["decode_b1_ms"] == fp8["decode_b1_ms"] / bf16["decode_b1_ms"]
        assert ratio["offline_tok_s"] == fp8["offline_tok_s"] / bf16["offline_tok_s"]
    assert (
        "expert_bytes_per_value" in record["qwen3_moe_fp8"]
        and "expert_bytes_per_value" not in record["llama_fp8"]
    )
    assert len(record["targets"]) == 5 and record["benchmark"] == "lowbit"


def test_an_unknown_section_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        lowbit.main([*SMALL, "--out", str(tmp_path / "x.json"), "--only", "llama,qwen3"])
