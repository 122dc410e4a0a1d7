"""Low-bit weights on one GPU, with dummy weights drawn on the device (`load_format="dummy"`: the engine
draws them in the format config.json's `quantization_config` names) and the copy bandwidth measured in the
same run. Three sections, each its own engines in turn, one at a time in one process:

- `gpt_oss_120b`: the gpt-oss-120b shape (36 layers, 128 experts top 4) with MXFP4 experts, which stay
  4-bit on the GPU: `weights_gib`, `offline_tok_s` (benchmarks/offline.py's workload), `decode_b1_ms` (the
  batch-1 step under its CUDA graph at 512 tokens of context) and `decode_b1_floor_ms` (the bytes that step
  must read, gpt_oss.decode_b1_bytes: the 4 experts of its token in MXFP4's packed bytes and scales, the
  attention, router, LM head and embedding row in bf16, its KV; over the copy bandwidth).
- `qwen3_moe`: the Qwen3-30B-A3B shape with 128 x 128 block-scaled FP8 weights, experts and attention, as the
  hub's -FP8 releases ship them (`qwen3_moe_fp8`), against bf16 (`qwen3_moe_bf16`): `decode_b1_ms` and
  `offline_tok_s` each, and `qwen3_moe_fp8_over_bf16` their ratios.
- `llama`: the Llama-3.1-8B shape, the same FP8 against bf16 (`llama_fp8`, `llama_bf16`,
  `llama_fp8_over_bf16`).

Each engine's entry names what ran: its layers made FP8 (`fp8_layers`), the FP8 GEMM, and for a mixture
of experts the bytes an expert weight is held in (`expert_bytes_per_value`: 0.53 for MXFP4, 1 plus its
scales for FP8, 2 for bf16); `runs` the commit, time and workload of each section. Each run merges
its sections into `--out`, so the sections may run in separate calls:

    python benchmarks/lowbit.py --only gpt_oss_120b --out benchmarks/results/lowbit-h200.json
    python benchmarks/lowbit.py --only qwen3_moe --out benchmarks/results/lowbit-h200.json
    python benchmarks/lowbit.py --only llama --out benchmarks/results/lowbit-h200.json
    python benchmarks/lowbit.py --tiny --device cpu --out /tmp/lowbit.json   # every step, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks import gpt_oss, moe
from tandem.benchmarks.common import (
    RESULTS,
    measure_ceilings,
    read_record,
    release_memory,
    run_stamp,
    write_record,
)
from tandem.benchmarks.offline import add_workload_args, pages_for, smoke_workload, workload, workload_config
from tandem.benchmarks.shapes import LLAMA_3_1_8B, write_dummy_model

# As the hub's -FP8 releases (Qwen3, DeepSeek-V3) write it: weight_scale_inv per 128 x 128 block.
FP8_BLOCK: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
LLAMA_TINY: dict[str, Any] = {
    **LLAMA_3_1_8B,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 10240,  # the workload's ids go up to 10,000
}


@dataclass(frozen=True)
class Model:
    """One engine's model: a family's shape, in the format `quantization` names (None: bf16)."""

    family: str
    shape: dict[str, Any]
    quantization: dict[str, Any] | None


def sections(tiny: bool) -> dict[str, dict[str, Model]]:
    """Each section's engines, by result key; FP8 against bf16 sections list FP8 first."""
    gpt_shape = gpt_oss.TINY if tiny else gpt_oss.GPT_OSS_120B
    qwen_shape = moe.TINY if tiny else moe.QWEN3_30B_A3B
    llama_shape = LLAMA_TINY if tiny else LLAMA_3_1_8B
    return {
        "gpt_oss_120b": {"gpt_oss_120b": Model("gpt_oss", gpt_shape, gpt_oss.MXFP4_CONFIG)},
        "qwen3_moe": {
            "qwen3_moe_fp8": Model("qwen3_moe", qwen_shape, FP8_BLOCK),
            "qwen3_moe_bf16": Model("qwen3_moe", qwen_shape, None),
        },
        "llama": {
            "llama_fp8": Model("llama", llama_shape, FP8_BLOCK),
            "llama_bf16": Model("llama", llama_shape, None),
        },
    }


def measure(key: str, model: Model, args: argparse.Namespace, ceilings: dict[str, float]) -> dict[str, Any]:
    """One engine: weights, the offline workload, the batch-1 decode step (and, for gpt-oss, its floor)."""
    device = torch.device(args.device)
    model_dir = write_dummy_model(
        args.model_root / key, model.family, model.shape, quantization=model.quantization
    )
    prompts, params = workload(args)
    print(f"{key}: building the engine", flush=True)
    start = time.perf_counter()
    llm = gpt_oss.dummy_llm(model_dir, device, pages_for(prompts, params), args.max_running)
    engine = llm.runtime.engine
    init_s = time.perf_counter() - start
    out: dict[str, Any] = {
        "weights_gib": engine.weight_bytes / 2**30,
        "quantization_config": model.quantization,
        "fp8_layers": engine.fp8_layers,
        "fp8_gemm": engine.config.fp8_gemm,
        "mxfp4_experts": engine.mxfp4_experts,
    }
    if engine.model_config.moe is not None:
        out["expert_bytes_per_value"] = gpt_oss.expert_bytes_per_value(llm)
    experts = out.get("expert_bytes_per_value")
    print(f"{key}: engine in {init_s:.0f} s, weights {out['weights_gib']:.2f} GiB, "
          f"{engine.fp8_layers} FP8 layers, experts at {experts} B a value", flush=True)  # fmt: skip
    out["offline_tok_s"] = gpt_oss.throughput(llm, prompts, params, device)
    print(f"{key}: offline {out['offline_tok_s']:.0f} output tok/s", flush=True)
    out["decode_b1_ms"] = moe.decode_timings(llm, args.steps, batches=(1,))[0]["ms"]
    if model.family == "gpt_oss":
        elem = engine.config.dtype.itemsize
        floor = gpt_oss.decode_b1_bytes(engine.model_config, moe.CONTEXT, out["expert_bytes_per_value"], elem)
        floor_ms = floor["total"] / (ceilings["copy_bandwidth_GBps"] * 1e9) * 1e3
        out.update(decode_b1_floor_ms=floor_ms, decode_b1_over_floor=out["decode_b1_ms"] / floor_ms,
                   decode_b1_floor_bytes=floor)  # fmt: skip
        print(f"{key}: decode b1 {out['decode_b1_ms']:.3f} ms, floor {floor_ms:.3f} ms", flush=True)
    out.update(engine_init_s=init_s, graph_capture_s=engine.capture_seconds, decode_context=moe.CONTEXT,
               copy_bandwidth_GBps=ceilings["copy_bandwidth_GBps"], model_shape=model.shape)  # fmt: skip
    llm.shutdown()
    del llm, engine
    release_memory()
    return out


def add_ratios(record: dict[str, Any]) -> None:
    """FP8 over bf16, for each pair both of whose engines have run, and the issue's targets."""
    targets: dict[str, bool | None] = {}
    for pair in ("qwen3_moe", "llama"):
        fp8, bf16 = record.get(f"{pair}_fp8"), record.get(f"{pair}_bf16")
        if fp8 is None or bf16 is None:
            continue
        decode = fp8["decode_b1_ms"] / bf16["decode_b1_ms"]
        offline = fp8["offline_tok_s"] / bf16["offline_tok_s"]
        record[f"{pair}_fp8_over_bf16"] = {"decode_b1_ms": decode, "offline_tok_s": offline}
        targets[f"{pair}_fp8.decode_b1_ms <= 0.62 x {pair}_bf16.decode_b1_ms"] = decode <= 0.62
        targets[f"{pair}_fp8.offline_tok_s >= 1.15 x {pair}_bf16.offline_tok_s"] = offline >= 1.15
    big = record.get("gpt_oss_120b")
    if big is not None:
        targets["gpt_oss_120b.decode_b1_ms <= 1.5 x decode_b1_floor_ms"] = big["decode_b1_over_floor"] <= 1.5
    record["targets"] = targets


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = list(sections(tiny=False))
    parser.add_argument(
        "--only", default=",".join(names), help=f"comma-separated sections, of {', '.join(names)}"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "lowbit-h200.json", help="merged into if present"
    )
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes of the same families")
    add_workload_args(parser)
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per repeat")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--model-root", type=Path, default=Path("/tmp/tandem-bench/lowbit"))
    args = parser.parse_args(argv)
    chosen = args.only.split(",")
    if unknown := set(chosen) - set(names):
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(names)}")
    if args.tiny:
        smoke_workload(args)
        args.steps = min(args.steps, 5)
        args.model_root = args.model_root.with_name(args.model_root.name + "-tiny")
    device = torch.device(args.device)
    record = read_record(args.out)
    for section in chosen:
        started = time.perf_counter()
        ceilings = measure_ceilings(device)
        print(f"{section}: copy {ceilings['copy_bandwidth_GBps']} GB/s", flush=True)
        for key, model in sections(args.tiny)[section].items():
            record[key] = measure(key, model, args, ceilings)
        record.setdefault("ceilings", {})[section] = ceilings
        record.setdefault("runs", {})[section] = {
            **run_stamp(),
            "total_s": time.perf_counter() - started,
            "workload": {**workload_config(args), "max_running": args.max_running},
            "decode_steps_per_repeat": args.steps,
        }
    add_ratios(record)
    out: Path = write_record(args.out, "lowbit", record, device=device)
    print(f"\n{out}\n{json.dumps(record['targets'], indent=1)}", flush=True)
    return out


if __name__ == "__main__":
    main()
