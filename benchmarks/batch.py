"""`tandem.batch` against `LLM.generate` on nano-vllm's offline workload, measured in one run.

The workload is benchmarks/offline.py's, draw for draw (256 requests, prompt and output lengths
U(100, 1024) after random.seed(0), T=0.6, ignore_eos, 133,966 output tokens), on the Qwen3-0.6B shape with
random bf16 weights. Three runs, in this order, on the same engine options:

1. `LLM.generate` in this process, after a warm-up, timed around the call: `offline_tok_s`;
2. the same requests as a Ray dataset (one row per request: `prompt` as token ids, `sampling_params`)
   through `tandem.batch` with concurrency=1: one actor, its engine in a rank actor of its own, as a
   serving replica runs it. Every request reaches the engine at once, as in `LLM.generate`
   (batch_size x max_concurrent_batches >= the request count). `batch_tok_s` is output tokens over the
   engine's window, the longest row's `time_taken_llm` (from the row's hand-over to the request path to
   its last token); the actor's start (Ray worker, model load, graph capture, warm-up) is outside it, as
   `LLM()`'s construction is outside offline_tok_s. The whole dataset's wall time is reported too;
3. `LLM.generate` again, so drift over the run shows: offline_tok_s is the mean of runs 1 and 3.

Target: batch_tok_s / offline_tok_s >= 0.9.

    python benchmarks/batch.py                               # H200: writes results/batch-h200.json
    python benchmarks/batch.py --device cpu --preset tiny    # CPU smoke: the tiny model, 24 requests
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.benchmarks.common import RESULTS, release_memory, sync, write_result
from tandem.benchmarks.offline import add_workload_args, pages_for, workload, workload_config
from tandem.benchmarks.shapes import QWEN3_0_6B, write_random_model

TARGET = 0.9
# A small CPU run of the same steps: the tiny model (512 ids), short prompts and outputs.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {},
    "tiny": {"num_seqs": 24, "min_input": 16, "max_input": 64, "min_output": 8, "max_output": 32},
}


def requests(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = workload(args)
    if vocab <= 10000:  # the tiny preset: fold the draws into its vocabulary
        prompts = [[t % vocab for t in p] for p in prompts]
    return prompts, params


def engine_options(
    args: argparse.Namespace, prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, Any]:
    return {
        "page_size": 16,
        "num_pages": pages_for(prompts, params),
        "max_running": args.max_running,
        "chunk_size": args.chunk_size,
    }


def run_offline(
    model: Path, device: str, options: dict[str, Any], prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, Any]:
    llm = LLM(str(model), device=device, **options)
    # As offline.py: first-use kernel setup stays out of the timing.
    llm.generate(prompts[:8], SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True), use_tqdm=False)
    sync(torch.device(device))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(torch.device(device))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    llm.shutdown()
    del llm
    release_memory()
    return {"elapsed_s": round(elapsed, 3), "output_tokens": tokens, "tok_s": round(tokens / elapsed, 1)}


def run_batch(
    model: Path,
    device: str,
    options: dict[str, Any],
    prompts: list[list[int]],
    params: list[SamplingParams],
    args: argparse.Namespace,
) -> dict[str, Any]:
    import ray

    from tandem.batch import ProcessorConfig, build_processor

    rows = [
        {
            "request": i,
            "prompt": p,
            "sampling_params": {"max_tokens": s.max_tokens, "temperature": s.temperature, "ignore_eos": True},
        }
        for i, (p, s) in enumerate(zip(prompts, params))
    ]
    config = ProcessorConfig(
        model_source=str(model),
        concurrency=1,
        batch_size=args.batch_size,
        max_concurrent_batches=args.max_concurrent_batches,
        device=device,
        engine_kwargs=options,
    )
    processor = build_processor(
        config,
        postprocess=lambda row: {
            "request": row["request"],
            "tokens": row["num_generated_tokens"],
            "seconds": row["time_taken_llm"],
            "error": row["error"],
        },
    )
    start = time.perf_counter()
    out = processor(ray.data.from_items(rows)).take_all()
    wall = time.perf_counter() - start
    errors = [r["error"] for r in out if r["error"]]
    assert not errors, errors[:3]
    assert sorted(r["request"] for r in out) == list(range(len(rows))), "rows lost or duplicated"
    tokens = sum(r["tokens"] for r in out)
    window = max(r["seconds"] for r in out)
    return {
        "window_s": round(window, 3),
        "wall_s": round(wall, 3),
        "start_and_overhead_s": round(wall - window, 3),
        "output_tokens": tokens,
        "tok_s": round(tokens / window, 1),
        "wall_tok_s": round(tokens / wall, 1),
        "row_seconds_median": round(statistics.median(r["seconds"] for r in out), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", choices=list(PRESETS), default="qwen3-0.6b", help="model and workload size"
    )
    add_workload_args(parser)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64, help="the processor's rows per batch")
    parser.add_argument(
        "--max-concurrent-batches", type=int, default=8, help="batches the actor runs at once"
    )
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem-bench/qwen3-0.6b"))
    parser.add_argument(
        "--device", default="cuda", help="cpu only to smoke-test this script (with --preset tiny)"
    )
    parser.add_argument(
        "--name", default=None, help="result file name (default batch-h200, or batch-<preset>-cpu)"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    for key, value in PRESETS[args.preset].items():
        setattr(args, key, value)
    try:
        import ray
        import ray.data  # needs pyarrow and pandas: ray[data]
    except ImportError as exc:
        parser.error(f"tandem.batch needs Ray Data: pip install 'ray[data]' ({exc})")

    device = torch.device(args.device)
    start = time.perf_counter()
    if args.preset == "tiny":
        from tandem.engine.tiny import make_tiny_model

        model, vocab, shape = (
            make_tiny_model(Path("/tmp/tandem-bench/tiny-qwen3"), "qwen3"),
            512,
            {"preset": "tiny qwen3"},
        )
    else:
        model = write_random_model(args.model_dir, "qwen3", device=device, **QWEN3_0_6B)
        vocab, shape = QWEN3_0_6B["vocab_size"], QWEN3_0_6B
    model_s = time.perf_counter() - start
    prompts, params = requests(args, vocab)
    if args.batch_size * args.max_concurrent_batches < len(prompts):
        parser.error(
            "batch_size x max_concurrent_batches must cover every request, as LLM.generate takes them"
        )
    options = engine_options(args, prompts, params)
    expected = sum(p.max_tokens for p in params)

    offline = [run_offline(model, args.device, options, prompts, params)]
    print(f"offline: {offline[0]['tok_s']:.0f} output tok/s", flush=True)
    # Logical CPUs for the actor, its rank and Ray Data's tasks, even on a small machine's smoke run.
    ray.init(num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False, log_to_driver=False)
    try:
        batch = run_batch(model, args.device, options, prompts, params, args)
    finally:
        ray.shutdown()
    print(
        f"batch: {batch['tok_s']:.0f} output tok/s over the engine window ({batch['wall_s']:.1f} s wall)",
        flush=True,
    )
    offline.append(run_offline(model, args.device, options, prompts, params))
    for run in (*offline, batch):
        assert run["output_tokens"] == expected, "ignore_eos runs must produce every token"
    offline_tok_s = statistics.mean(r["tok_s"] for r in offline)
    ratio = batch["tok_s"] / offline_tok_s
    name = args.name or ("batch-h200" if device.type == "cuda" else f"batch-{args.preset}-cpu")
    payload = {
        "config": {
            "model": "Qwen3-0.6B shape, random bf16 weights"
            if args.preset != "tiny"
            else "tiny qwen3 (CPU smoke)",
            "model_shape": shape,
            **workload_config(args),
            "engine": options,
            "processor": {
                "concurrency": 1,
                "batch_size": args.batch_size,
                "max_concurrent_batches": args.max_concurrent_batches,
            },
        },
        "offline_tok_s": round(offline_tok_s, 1),
        "batch_tok_s": batch["tok_s"],
        "ratio": round(ratio, 4),
        "target_ratio": TARGET,
        "meets_target": ratio >= TARGET,
        "runs": {"offline_first": offline[0], "batch": batch, "offline_last": offline[1]},
        "definitions": {
            "offline_tok_s": "output tokens / LLM.generate wall time; the mean of the runs before and after "
            "the batch run",
            "batch_tok_s": "output tokens / the longest row's time_taken_llm (hand-over to last token); "
            "every request is in flight at once",
            "wall_s": "the whole dataset: Ray Data's start, the actor's start, model load, warm-up, the rows",
        },
        "model_write_s": round(model_s, 1),
    }
    path = write_result(name, payload, device=device, out_dir=args.out_dir)
    print(f"\n{path}")
    print(
        f"batch_tok_s {batch['tok_s']:.0f}, offline_tok_s {offline_tok_s:.0f}: ratio {ratio:.3f} "
        f"(target >= {TARGET}) {'MET' if ratio >= TARGET else 'NOT MET'}"
    )


if __name__ == "__main__":
    main()
