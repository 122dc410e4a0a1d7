"""Multi-LoRA against the base model, in one run on one GPU: a Llama-3.1-8B shape (random bf16 weights)
with 8 random rank-16 adapters on all seven projections.

- `base_tok_s`, `mixed_tok_s`: output tokens/s on nano-vllm's offline workload (the draws of
  benchmarks/offline.py: 256 sequences, prompts and outputs U(100, 1024), temperature 0.6, ignore_eos),
  with no adapter on an engine without LoRA, then with the 8 adapters assigned round-robin on an engine
  with `enable_lora=True, max_loras=8`. Target: mixed / base >= 0.85.
- `decode_b1_ms_base`, `decode_b1_ms_lora`: one batch-1 decode step at 512 tokens of context under CUDA
  graphs (benchmarks/engine_steps.py: plan, graph replay, sampling, result copy, pipelined), on the
  engine without LoRA, then on the LoRA engine with the row's adapter in a slot. Target: lora / base <=
  1.15. Also `decode_b1_ms_lora_engine_base_row`: the LoRA engine's step for a base row (its graph runs
  none of the LoRA kernels).

Every figure is measured in the same process, the baseline first. Writes benchmarks/results/lora-h200.json
(`--out`) with the device, the commit and the configuration.

    python benchmarks/lora.py                       # H200: dummy weights drawn on the device (no
                                                    # checkpoint); --load-format auto writes and loads one
    python benchmarks/lora.py --preset cpu-tiny --out /tmp/lora-cpu.json   # the same path on CPU, small
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.benchmarks.common import RESULTS, release_memory, sync, write_result
from tandem.benchmarks.engine_steps import decode_batch, seconds_per_step
from tandem.benchmarks.offline import pages_for, workload
from tandem.benchmarks.shapes import LLAMA_3_1_8B, write_dummy_model, write_random_model

PRESETS: dict[str, dict[str, Any]] = {
    "h200": {
        "device": "cuda",
        "shape": LLAMA_3_1_8B,
        "num_seqs": 256,
        "max_output": 1024,
        "max_input": 1024,
        "decode_steps": 100,
        "model_dir": Path("/tmp/tandem-bench/llama-8b-32l"),
    },
    "cpu-tiny": {  # the whole path on CPU in about a minute: a 2-layer, 128-wide Llama shape
        "device": "cpu",
        "shape": {
            "num_hidden_layers": 2,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "vocab_size": 512,
            "tie_word_embeddings": False,
            "max_position_embeddings": 4096,
        },
        "num_seqs": 16,
        "max_output": 48,
        "max_input": 96,
        "decode_steps": 10,
        "model_dir": Path("/tmp/tandem-bench/llama-tiny-lora"),
    },
}
TARGETS = {"mixed_over_base": 0.85, "lora_over_base_b1": 1.15}
CONTEXT = 512


def adapters(root: Path, model_dir: Path, count: int, rank: int, device: torch.device) -> list[Path]:
    """`count` random adapters of `rank` on all seven projections, reused when `root` holds the same."""
    from tandem.engine.tiny.adapters import write_random_adapter

    spec = {"count": count, "rank": rank, "model": str(model_dir), "version": 1}
    marker = root / "tandem-random-adapters.json"
    paths = [root / f"adapter{i}" for i in range(count)]
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return paths
    for i, path in enumerate(paths):
        write_random_adapter(
            path,
            model_dir,
            rank=rank,
            alpha=2 * rank,
            seed=100 + i,
            dtype=torch.bfloat16,
            device=device,
            b_std=0.05,
        )
    marker.write_text(json.dumps(spec))
    return paths


def offline(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], loras: list[LoRARequest] | None
) -> dict[str, Any]:
    """The workload once untimed on its first 8 prompts (kernel builds, slot loads), then timed."""
    assign = None if loras is None else [loras[i % len(loras)] for i in range(len(prompts))]
    warm = SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True)
    llm.generate(prompts[:8], warm, lora_request=None if assign is None else assign[:8], use_tqdm=False)
    device = llm.runtime.engine.config.device
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=assign, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(p.max_tokens for p in params), "ignore_eos runs must produce every token"
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed}


def decode_ms(llm: LLM, steps: int, slot: int | None) -> float:
    """One batch-1 decode step under the engine's graphs; `slot`: the row's adapter slot (None: base)."""
    import dataclasses

    engine = llm.runtime.engine
    batch = decode_batch(engine, [CONTEXT])
    if slot is not None:
        batch = dataclasses.replace(batch, lora_slots_cpu=torch.tensor([slot], dtype=torch.int32))
    return 1e3 * seconds_per_step(engine, batch, steps=steps)


def engine_options(args: argparse.Namespace, num_pages: int) -> dict[str, Any]:
    return {
        "device": args.device,
        "page_size": 16,
        "num_pages": num_pages,
        "max_running": 256,
        "load_format": args.load_format,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "lora-h200.json")
    parser.add_argument(
        "--load-format",
        choices=["dummy", "auto"],
        default="dummy",
        help="dummy (default): random weights drawn on the device; auto: random weights written to a "
        "checkpoint first and loaded from it",
    )
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    args.device = preset["device"]
    device = torch.device(args.device)
    shape = {**preset["shape"]}
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    model_dir = args.model_dir or preset["model_dir"]
    if args.layers is not None and args.model_dir is None:
        model_dir = model_dir.with_name(f"{model_dir.name}-{args.layers}l")
    start = time.perf_counter()
    if args.load_format == "dummy":  # config and tokenizer only: both engines draw the weights on the device
        model_dir = write_dummy_model(model_dir.with_name(model_dir.name + "-dummy"), "llama", shape)
    else:
        model_dir = write_random_model(model_dir, "llama", device=device, **shape)
    paths = adapters(
        model_dir.with_name(model_dir.name + f"-lora-r{args.rank}"),
        model_dir,
        args.adapters,
        args.rank,
        device,
    )
    prepared_s = time.perf_counter() - start
    print(f"model and {len(paths)} adapters ready in {prepared_s:.0f} s", flush=True)
    work = argparse.Namespace(
        num_seqs=preset["num_seqs"],
        min_input=min(100, preset["max_input"]),
        max_input=preset["max_input"],
        min_output=min(100, preset["max_output"]),
        max_output=preset["max_output"],
    )
    prompts, params = workload(work)
    vocab = shape["vocab_size"]
    prompts = [[t % vocab for t in p] for p in prompts]  # the draws' ids up to 10000, within any head
    num_pages = pages_for(prompts, params)
    steps = preset["decode_steps"]
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    result: dict[str, Any] = {}

    llm = LLM(str(model_dir), **engine_options(args, num_pages))
    base = offline(llm, prompts, params, None)
    result["decode_b1_ms_base"] = decode_ms(llm, steps, None)
    base_switches = llm.runtime.engine.config.switches()
    llm.shutdown()
    del llm
    release_memory()
    print(f"base: {base['output_tok_per_s']:.0f} tok/s, b1 {result['decode_b1_ms_base']:.3f} ms", flush=True)

    start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        **engine_options(args, num_pages),
    )
    lora_init_s = time.perf_counter() - start
    mixed = offline(llm, prompts, params, loras)
    slots = llm.runtime.scheduler.lora
    assert slots is not None
    result["decode_b1_ms_lora"] = decode_ms(llm, steps, 0)
    result["decode_b1_ms_lora_engine_base_row"] = decode_ms(llm, steps, None)
    engine = llm.runtime.engine
    lora_stats = {k: v for k, v in llm.stats().items() if k.startswith("lora_")}
    lora_switches = engine.config.switches()
    capture_s = engine.capture_seconds
    slot_bytes = engine.lora.slot_bytes if engine.lora is not None else 0
    llm.shutdown()
    del llm, engine
    release_memory()

    result |= {
        "base_tok_s": base["output_tok_per_s"],
        "mixed_tok_s": mixed["output_tok_per_s"],
        "mixed_over_base": mixed["output_tok_per_s"] / base["output_tok_per_s"],
        "lora_over_base_b1": result["decode_b1_ms_lora"] / result["decode_b1_ms_base"],
    }
    result["targets"] = TARGETS
    result["targets_met"] = {
        "mixed_over_base": result["mixed_over_base"] >= TARGETS["mixed_over_base"],
        "lora_over_base_b1": result["lora_over_base_b1"] <= TARGETS["lora_over_base_b1"],
    }
    payload = {
        "config": {
            "preset": args.preset,
            "model": "Llama-3.1-8B shape, random bf16 weights"
            if args.preset == "h200"
            else "tiny Llama shape",
            "model_shape": shape,
            "adapters": {
                "count": args.adapters,
                "rank": args.rank,
                "alpha": 2 * args.rank,
                "targets": "q, k, v, o, gate, up, down",
                "assignment": "round-robin",
            },
            "workload": {
                **vars(work),
                "temperature": 0.6,
                "ignore_eos": True,
                "seed": 0,
                "output_tokens": sum(p.max_tokens for p in params),
            },
            "decode": {"batch": 1, "context": CONTEXT, "steps_per_repeat": steps, "cuda_graph": True},
            "engine": engine_options(args, num_pages),
            "switches_base": base_switches,
            "switches_lora": lora_switches,
        },
        **result,
        "runs": {"base": base, "mixed": mixed},
        "lora_stats": lora_stats,
        "lora_slot_bytes": slot_bytes,
        "lora_engine_init_s": lora_init_s,
        "lora_engine_graph_capture_s": capture_s,
        "prepare_s": prepared_s,
    }
    path = write_result(args.out.stem, payload, device=device, out_dir=args.out.parent)
    summary = {
        k: result[k]
        for k in (
            "base_tok_s",
            "mixed_tok_s",
            "mixed_over_base",
            "decode_b1_ms_base",
            "decode_b1_ms_lora",
            "lora_over_base_b1",
            "targets_met",
        )
    }
    print(json.dumps(summary, indent=2))
    print(path)


if __name__ == "__main__":
    main()
