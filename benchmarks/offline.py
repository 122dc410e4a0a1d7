"""Offline throughput: a fixed batch of random requests through `tandem.LLM`, with ablations.

The workload (nano-vllm's bench.py, draw for draw): 256 sequences,
prompt lengths U(100, 1024) of random ids up to 10000, output lengths U(100, 1024) (133,966 tokens),
random.seed(0), ignore_eos, temperature 0.6, on a
Qwen3-0.6B-shaped model with random bf16 weights. Reported: output tokens/s per switch setting, and
the roofline floor from this run's own measured copy bandwidth and matmul rate:

    floor = (weight bytes x decode steps + KV bytes read by decode) / bandwidth + prefill FLOPs / matmul rate

where decode steps = the longest output (each step reads every weight once) and each decode token
reads its row's whole KV. It ignores decode FLOPs and overheads, so no engine reaches it.

    python benchmarks/offline.py --quick          # about 2-3 minutes on an H200, first kernel builds aside
    python benchmarks/offline.py                  # the full workload and every ablation
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.benchmarks.common import (
    RESULTS,
    allocator_counters,
    bar_chart,
    counter_deltas,
    measure_ceilings,
    print_table,
    release_memory,
    sync,
    write_result,
)
from tandem.benchmarks.shapes import QWEN3_0_6B, ModelCost, write_random_model
from tandem.engine.config import ModelConfig

ABLATIONS: dict[str, dict[str, Any]] = {
    "all-on": {},
    "no-overlap": {"overlap": False},
    "no-cuda-graph": {"cuda_graph": False},
    "no-piecewise": {"piecewise_cuda_graph": False},
    "no-copy-stream": {"copy_stream": False},
    "no-fused-kernels": {"fused_kernels": False},
    # The one-launch small-batch decode and Triton norms off, and on for every decode graph.
    "fused-decode-off": {"fused_decode_max_bs": 0},
    "all-off": {"overlap": False, "cuda_graph": False, "piecewise_cuda_graph": False, "copy_stream": False},
}


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's size: how many sequences, and the ranges their prompt and output lengths are drawn
    from (nano-vllm's defaults)."""
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input", type=int, default=100)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--min-output", type=int, default=100)
    parser.add_argument("--max-output", type=int, default=1024)


def smoke_workload(args: argparse.Namespace) -> None:
    """A tiny shape's CPU smoke run: 8 short sequences, unless the command line set another size."""
    if args.num_seqs == 256:
        args.num_seqs, args.max_input, args.max_output, args.min_input, args.min_output = 8, 48, 24, 8, 8


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py draws, in its order: every prompt first, then every output length (133,966
    output tokens at the defaults). Its ids come from randint(0, 10000), which includes 10000 (12 of the
    142,827 prompt ids); the same call keeps the stream, and so the lengths, the same. Drawing each
    sequence's output length right after its prompt, with ids up to 9999, as this did before
    2026-11-29, gave other lengths from the same distributions: 137,723 output tokens."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(args.min_input, args.max_input))]
        for _ in range(args.num_seqs)
    ]
    params = [
        SamplingParams(
            max_tokens=random.randint(args.min_output, args.max_output), temperature=0.6, ignore_eos=True
        )
        for _ in range(args.num_seqs)
    ]
    return prompts, params


def workload_config(args: argparse.Namespace) -> dict[str, Any]:
    """The workload's description for a result file."""
    return {
        "num_seqs": args.num_seqs,
        "input_len": [args.min_input, args.max_input],
        "output_len": [args.min_output, args.max_output],
        "temperature": 0.6,
        "ignore_eos": True,
        "seed": 0,
    }


def pages_for(prompts: list[list[int]], params: list[SamplingParams], page_size: int = 16) -> int:
    """Enough KV pages for every sequence at once (plus slack), so the pool never limits the batch."""
    return int(sum(-(-(len(p) + s.max_tokens) // page_size) for p, s in zip(prompts, params)) * 1.1) + 64


FLOOR_FORMULA = (
    "(weight bytes x (longest output - 1) + KV bytes read by decode tokens) / copy bandwidth"
    " + prefill FLOPs / bf16 matmul rate"
)


def floor_seconds(
    cost: ModelCost, prompts: list[list[int]], params: list[SamplingParams], ceilings: dict[str, float]
) -> dict[str, float]:
    bandwidth = ceilings["copy_bandwidth_GBps"] * 1e9
    rate = ceilings["bf16_matmul_TFLOPs"] * 1e12
    # Output token 0 comes from the prefill; tokens 1.. each read their row's KV at its context.
    kv_read = sum(
        cost.kv_read_bytes(len(p) + j) for p, s in zip(prompts, params) for j in range(1, s.max_tokens)
    )
    decode_steps = max(s.max_tokens for s in params) - 1
    prefill_flops = sum(cost.prefill_flops(len(p)) for p in prompts)
    memory_s = (cost.weight_bytes * decode_steps + kv_read) / bandwidth
    compute_s = prefill_flops / rate
    return {
        "floor_s": memory_s + compute_s,
        "decode_memory_s": memory_s,
        "prefill_compute_s": compute_s,
        "kv_read_GB": kv_read / 1e9,
        "weight_GB": cost.weight_bytes / 1e9,
        "decode_steps": decode_steps,
        "prefill_TFLOP": prefill_flops / 1e12,
    }


def run_one(
    model_dir: Path,
    switches: dict[str, Any],
    prompts: list[list[int]],
    params: list[SamplingParams],
    args: argparse.Namespace,
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "device": args.device,
        "page_size": 16,
        "num_pages": args.num_pages,
        "max_running": args.max_running,
        "chunk_size": args.chunk_size,
        **switches,
    }
    start = time.perf_counter()
    llm = LLM(str(model_dir), **options)
    init_s = time.perf_counter() - start
    engine = llm.runtime.engine
    # Warm-up: first-use kernel setup (and flashinfer builds, if not cached) stays out of the timing.
    llm.generate(prompts[:8], SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True), use_tqdm=False)
    sync(engine.config.device)
    timer = llm.runtime.scheduler.timer
    timer.reset()
    counters = allocator_counters()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(engine.config.device)
    elapsed = time.perf_counter() - start
    allocations = counter_deltas(counters, allocator_counters())
    phases = timer.summary()
    output_tokens = sum(len(o.token_ids) for o in outs)
    assert output_tokens == sum(p.max_tokens for p in params), "ignore_eos runs must produce every token"
    result = {
        "switches": {"overlap": options.get("overlap", True), **engine.config.switches()},
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (output_tokens + sum(map(len, prompts))) / elapsed,
        "engine_init_s": init_s,
        "graph_capture_s": engine.capture_seconds,
        # Loop phases (scheduler/step_timer.py): `wait` (blocked on the device) sits inside
        # `process_results`; the rest of schedule + launch + process_results is host time.
        "step_phases": phases,
        "host_ms_per_step": host_ms_per_step(phases),
        # Allocator slow paths during the timed run (cudaHostAlloc, cudaMalloc): why a first run may lag.
        "allocations": allocations,
    }
    llm.shutdown()
    del llm, engine
    release_memory()
    return result


def host_ms_per_step(phases: dict[str, dict[str, float]]) -> float | None:
    """Mean host milliseconds per launched step: schedule + launch + processing, minus the device wait."""
    launches = phases.get("launch", {}).get("calls", 0)
    if not launches:
        return None
    busy = sum(phases.get(p, {}).get("total_s", 0.0) for p in ("schedule", "launch", "process_results"))
    return round(1e3 * (busy - phases.get("wait", {}).get("total_s", 0.0)) / launches, 4)


def hf_peer(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """transformers' continuous batching (paged|sdpa) on the same weights. Its generate_batch takes one
    output length for all requests, so every request generates the mean length (same total tokens)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).cuda()
    mean_out = round(sum(p.max_tokens for p in params) / len(params))
    config = GenerationConfig(
        max_new_tokens=mean_out, do_sample=True, temperature=0.6, eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=config)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    del model
    release_memory()
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
        "output_len_each": mean_out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="128 sequences, outputs up to 512, fewer ablations"
    )
    add_workload_args(parser)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument(
        "--ablations",
        default="",
        help=f"comma list of {', '.join(ABLATIONS)}; default: all (quick: no all-off)",
    )
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem-bench/qwen3-0.6b"))
    parser.add_argument("--hf-peer", action="store_true", help="also run transformers continuous batching")
    parser.add_argument("--tag", default="", help="suffix for the result file name")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.num_seqs, args.max_output = min(args.num_seqs, 128), min(args.max_output, 512)
    names = [n for n in (args.ablations.split(",") if args.ablations else ABLATIONS) if n]
    if args.quick and not args.ablations:
        names = [n for n in names if n != "all-off"]
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        parser.error(f"unknown ablations {unknown}; choose from {', '.join(ABLATIONS)}")

    device = torch.device(args.device)
    ceilings = measure_ceilings(device)
    start = time.perf_counter()
    model_dir = write_random_model(
        args.model_dir, "qwen3", device=device, **{**QWEN3_0_6B, "num_hidden_layers": args.layers}
    )
    model_s = time.perf_counter() - start
    prompts, params = workload(args)
    args.num_pages = pages_for(prompts, params)
    cost = ModelCost.of(ModelConfig.from_dir(model_dir))
    floor = floor_seconds(cost, prompts, params, ceilings)
    output_tokens = sum(p.max_tokens for p in params)
    runs = {}
    for name in names:
        runs[name] = run_one(model_dir, ABLATIONS[name], prompts, params, args)
        runs[name]["percent_of_roofline"] = 100 * floor["floor_s"] / runs[name]["elapsed_s"]
        wait = runs[name]["step_phases"].get("wait", {}).get("mean_ms")
        launch = runs[name]["step_phases"].get("launch", {})
        print(
            f"{name}: {runs[name]['output_tok_per_s']:.0f} output tok/s; host "
            f"{runs[name]['host_ms_per_step']} ms/step, device wait {wait} ms/step; launch longest "
            f"{launch.get('max_ms')} ms, {launch.get('stalls')} stalled; {runs[name]['allocations']}",
            flush=True,
        )
    peer = None
    if args.hf_peer:
        try:
            peer = hf_peer(model_dir, prompts, params)
        except Exception as exc:  # optional: report why, keep the tandem results
            peer = {"error": repr(exc)}
    name = "offline-qwen3-0.6b" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    payload = {
        "config": {
            "model": "Qwen3-0.6B shape, random bf16 weights",
            "model_shape": {**QWEN3_0_6B, "num_hidden_layers": args.layers},
            "num_seqs": args.num_seqs,
            "input_len": [args.min_input, args.max_input],
            "output_len": [args.min_output, args.max_output],
            "token_ids": [0, 9999],
            "temperature": 0.6,
            "ignore_eos": True,
            "seed": 0,
            "max_running": args.max_running,
            "chunk_size": args.chunk_size,
            "num_pages": args.num_pages,
            "page_size": 16,
        },
        "ceilings": ceilings,
        "roofline": {
            **floor,
            "output_tok_per_s_at_floor": output_tokens / floor["floor_s"],
            "formula": FLOOR_FORMULA,
        },
        "runs": runs,
        "hf_peer": peer,
        "model_write_s": model_s,
    }
    path = write_result(name, payload, device=device, out_dir=args.out_dir)
    labels = list(runs)
    bar_chart(
        path.with_suffix(".png"),
        labels,
        [runs[n]["output_tok_per_s"] for n in labels],
        ylabel="output tokens/s",
        title=f"{name} ({path.stem}): roofline {output_tokens / floor['floor_s']:.0f} tok/s",
        reference=output_tokens / floor["floor_s"],
    )
    rows = [
        {
            "setting": n,
            "tok/s": r["output_tok_per_s"],
            "% roofline": r["percent_of_roofline"],
            "elapsed s": r["elapsed_s"],
            "init s": r["engine_init_s"],
        }
        for n, r in runs.items()
    ]
    if peer is not None and "output_tok_per_s" in peer:
        rows.append({"setting": "hf-peer", "tok/s": peer["output_tok_per_s"], "elapsed s": peer["elapsed_s"]})
    at_floor = output_tokens / floor["floor_s"]
    print(f"\n{path}  (floor {floor['floor_s']:.2f} s = {at_floor:.0f} tok/s; {ceilings})")
    print_table(rows, ["setting", "tok/s", "% roofline", "elapsed s", "init s"])


if __name__ == "__main__":
    main()
