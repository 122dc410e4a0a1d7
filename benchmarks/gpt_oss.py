"""gpt-oss on one GPU: the gpt-oss-20b shape (24 layers, hidden 2880, 64/8 heads of 64 with sinks, every
other layer a 128-token window, 32 experts top 4 of intermediate 2880, vocabulary 201,088) with dummy
weights drawn on the device (`load_format="dummy"`), against ceilings measured in the same run.

- `offline_tok_s`: nano-vllm's offline workload (benchmarks/offline.py's draws) through `tandem.LLM`.
- `decode_b1_ms`: the decode step at batch 1 (and 8, 64, 256) under CUDA graphs at 512 tokens of context;
  `decode_b1_floor_ms`: the bytes a batch-1 step must read (attention weights and biases, the router, the
  k experts of its one token in the layout they are held in, the LM head, its KV: the window layers only
  their last `sliding_window` tokens) over the copy bandwidth.
- `swa_pcg`: SGLang's comparison of sliding-window eviction with piecewise CUDA graphs against piecewise
  graphs off: `--swa-requests` gsm8k-like requests at once (prompts of about 200 tokens, answers of 256),
  run both ways in one process: `on_tok_s` and `pcg_off_tok_s`.

The experts are MXFP4 by default, as the hub's checkpoints ship them (`quantization_config.quant_method:
mxfp4` in config.json: on CUDA they stay 4-bit, see docs/serve-config.md); `--experts bf16` draws them in
bf16. `--parts` runs some of the parts; each run merges its fields into the result file, so the parts
may run in separate processes.

    python benchmarks/gpt_oss.py                              # H200: every part
    python benchmarks/gpt_oss.py --parts offline,decode       # ...or in two calls
    python benchmarks/gpt_oss.py --parts swa_pcg
    python benchmarks/gpt_oss.py --preset tiny --device cpu   # the same steps on a tiny shape (smoke test)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.benchmarks.common import (
    RESULTS,
    measure_ceilings,
    print_table,
    read_record,
    release_memory,
    run_stamp,
    sync,
    write_record,
)
from tandem.benchmarks.moe import CONTEXT, decode_timings
from tandem.benchmarks.offline import add_workload_args, pages_for, smoke_workload, workload, workload_config
from tandem.benchmarks.shapes import write_dummy_model
from tandem.engine.config import ModelConfig
from tandem.engine.moe.experts import MoEExperts

GPT_OSS_20B: dict[str, Any] = {
    "num_hidden_layers": 24,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}
GPT_OSS_120B: dict[str, Any] = {
    **GPT_OSS_20B,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}
TINY: dict[str, Any] = {
    **GPT_OSS_20B,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "vocab_size": 10240,  # the workload's ids go up to 10,000
}
PRESETS = {"gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B, "tiny": TINY}
MXFP4_CONFIG: dict[str, Any] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
PARTS = ("offline", "decode", "swa_pcg")


def write_config(path: Path, shape: dict[str, Any], *, mxfp4: bool) -> Path:
    """config.json and the tiny tokenizer, and no weights: the engine draws them (load_format="dummy")."""
    return write_dummy_model(path, "gpt_oss", shape, quantization=MXFP4_CONFIG if mxfp4 else None)


def dummy_llm(
    model_dir: Path, device: torch.device, num_pages: int, max_running: int, **switches: Any
) -> LLM:
    """An `LLM` over `model_dir` with dummy weights drawn on `device` and `num_pages` KV pages of 16."""
    return LLM(str(model_dir), device=str(device), load_format="dummy", page_size=16, num_pages=num_pages,
               max_running=max_running, **switches)  # fmt: skip


def expert_bytes_per_value(llm: LLM) -> float:
    """The bytes one expert weight takes as the engine holds it: 4-bit values with one byte of scale per
    32 when the experts stay MXFP4 on the device, else the compute dtype's."""
    experts = next(m for m in llm.runtime.engine.model.modules() if isinstance(m, MoEExperts))
    held = sum(t.numel() * t.element_size() for t in experts.parameters()) + sum(
        t.numel() * t.element_size() for t in experts.buffers()
    )
    spec, shard = experts.spec, experts.shard
    values = shard.num_local * 3 * shard.inter_size * experts.hidden_size
    biases = shard.num_local * (2 * shard.inter_size + experts.hidden_size) if spec.expert_bias else 0
    return (held - biases * llm.runtime.engine.config.dtype.itemsize) / values


def decode_b1_bytes(c: ModelConfig, context: int, expert_elem: float, elem: int = 2) -> dict[str, float]:
    """What one batch-1 decode step must read, by part: only the k experts its token chose, at
    `expert_elem` bytes a weight (MXFP4: 0.5 for the packed values + 1 / 32 for the scales)."""
    assert c.moe is not None
    m, h, d = c.moe, c.hidden_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv + h) + c.num_heads  # weights, biases, sinks
    windows = [c.window_of(layer) for layer in range(c.num_layers)]
    kv_tokens = sum(min(context, w) if w else context for w in windows)
    parts = {
        "attention_weights": c.num_layers * (attention + 2 * h) * elem,
        "router": c.num_layers * m.num_experts * (h + 1) * elem,  # weight and bias
        "routed_experts": c.num_layers * m.top_k * (3 * h * m.expert_intermediate_size * expert_elem
                                                    + (2 * m.expert_intermediate_size + h) * elem),
        "lm_head": c.vocab_size * h * elem,
        "embedding_row": h * elem,
        "kv": kv_tokens * 2 * kv * elem,
    }  # fmt: skip
    parts["total"] = sum(parts.values())
    return parts


def gsm8k_like(n: int, vocab: int) -> tuple[list[list[int]], SamplingParams]:
    """`n` prompts of 180-220 random ids and 256-token answers, as SGLang's SWA comparison runs them."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(180, 220))] for _ in range(n)]
    return prompts, SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)


def throughput(llm: LLM, prompts: list[list[int]], params: Any, device: torch.device) -> float:
    """Output tokens per second of one `generate` over every prompt, after a short warm-up."""
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def swa_pcg(model_dir: Path, device: torch.device, requests: int, vocab: int) -> dict[str, Any]:
    """The gsm8k-like batch with window eviction under piecewise graphs, then with piecewise graphs off."""
    prompts, params = gsm8k_like(requests, vocab)
    pages = pages_for(prompts, [params] * len(prompts))
    rates = {}
    for key, piecewise in (("on_tok_s", True), ("pcg_off_tok_s", False)):
        start = time.perf_counter()
        llm = dummy_llm(model_dir, device, pages, requests, piecewise_cuda_graph=piecewise)
        print(
            f"swa_pcg {key}: engine in {time.perf_counter() - start:.0f} s, {requests} requests", flush=True
        )
        rates[key] = throughput(llm, prompts, params, device)
        llm.shutdown()
        del llm
        release_memory()
        print(f"swa_pcg {key}: {rates[key]:.0f} tok/s", flush=True)
    return {**rates, "ratio": rates["on_tok_s"] / rates["pcg_off_tok_s"], "requests": requests,
            "prompt_len": [180, 220], "output_len": 256}  # fmt: skip


def offline_and_decode(
    model_dir: Path, args: argparse.Namespace, parts: list[str], ceilings: dict[str, float]
) -> dict[str, Any]:
    """One engine: the offline workload, the decode steps, and the batch-1 floor from this run's copy
    bandwidth."""
    device = torch.device(args.device)
    prompts, params = workload(args)
    num_pages = max(pages_for(prompts, params), 256 * -(-(CONTEXT + 1) // 16) + 64)  # moe.BATCHES
    start = time.perf_counter()
    llm = dummy_llm(model_dir, device, num_pages, args.max_running)
    engine = llm.runtime.engine
    out: dict[str, Any] = {
        "engine_init_s": time.perf_counter() - start,
        "weights_gib": engine.weight_bytes / 2**30,
    }
    print(f"engine in {out['engine_init_s']:.0f} s, weights {out['weights_gib']:.1f} GiB", flush=True)
    expert_elem = expert_bytes_per_value(llm)
    if "offline" in parts:
        out["offline_tok_s"] = throughput(llm, prompts, params, device)
        print(f"offline: {out['offline_tok_s']:.0f} output tok/s", flush=True)
    if "decode" in parts:
        decode = decode_timings(llm, args.steps)
        floor = decode_b1_bytes(engine.model_config, CONTEXT, expert_elem, engine.config.dtype.itemsize)
        b1 = next(r["ms"] for r in decode if r["batch"] == 1)
        floor_ms = floor["total"] / (ceilings["copy_bandwidth_GBps"] * 1e9) * 1e3
        print(f"decode b1 {b1:.3f} ms, floor {floor_ms:.3f} ms ({b1 / floor_ms:.2f}x)", flush=True)
        out.update(decode_b1_ms=b1, decode_b1_floor_ms=floor_ms, decode_b1_over_floor=b1 / floor_ms,
                   decode_b1_floor_bytes=floor, decode_ms=decode)  # fmt: skip
    config = {
        "expert_bytes_per_value": expert_elem,
        "num_pages": num_pages,
        "switches": engine.config.switches(),
    }
    llm.shutdown()
    del llm, engine
    release_memory()
    return {**out, "engine": config}


def targets(record: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's targets, None while the parts they need have not run."""
    b1, floor, swa = record.get("decode_b1_ms"), record.get("decode_b1_floor_ms"), record.get("swa_pcg")
    return {
        "decode_b1_ms <= 1.4 x decode_b1_floor_ms": None
        if b1 is None or floor is None
        else b1 <= 1.4 * floor,
        "swa_pcg.on_tok_s / swa_pcg.pcg_off_tok_s >= 1.05": None if swa is None else swa["ratio"] >= 1.05,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="gpt-oss-20b")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                        help="the experts' checkpoint format (MXFP4 stays 4-bit on CUDA)")  # fmt: skip
    parser.add_argument("--mxfp4", dest="experts", action="store_const", const="mxfp4",
                        help="the same as --experts mxfp4, the default (older commands)")  # fmt: skip
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    add_workload_args(parser)
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per repeat")
    parser.add_argument("--swa-requests", type=int, default=1400)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    shape = PRESETS[args.preset]
    device = torch.device(args.device)
    if args.preset == "tiny":
        smoke_workload(args)
        args.steps, args.swa_requests = min(args.steps, 5), min(args.swa_requests, 8)
    started = time.perf_counter()
    mxfp4 = args.experts == "mxfp4"
    default_dir = Path(f"/tmp/tandem-bench/{args.preset}-{args.experts}")
    model_dir = write_config(args.model_dir or default_dir, shape, mxfp4=mxfp4)
    full = args.preset == "gpt-oss-20b" and device.type == "cuda" and mxfp4
    name = "gpt-oss-h200" if full else f"gpt-oss-{args.preset}-{args.experts}-{device.type}"
    path = args.out_dir / f"{name}.json"
    record = read_record(path)
    record["config"] = {
        "model": f"gpt-oss, {args.preset} shape, dummy weights (load_format='dummy')",
        "model_shape": shape,
        "experts": args.experts,
        "workload": workload_config(args),
        "max_running": args.max_running,
        "decode_context": CONTEXT,
    }
    if "offline" in parts or "decode" in parts:
        ceilings = measure_ceilings(device)
        record.update(offline_and_decode(model_dir, args, parts, ceilings), ceilings=ceilings)
    if "swa_pcg" in parts:
        record["swa_pcg"] = swa_pcg(model_dir, device, args.swa_requests, shape["vocab_size"])
    record["targets"] = targets(record)
    record.setdefault("runs", {}).update({part: {**run_stamp(), "total_s": time.perf_counter() - started}
                                          for part in parts})  # fmt: skip
    write_record(path, name, record, device=device)
    print(f"\n{path}\n{json.dumps(record['targets'])}")
    if "decode_ms" in record:
        print_table(record["decode_ms"], ["batch", "context", "ms", "cuda_graph"])


if __name__ == "__main__":
    main()
