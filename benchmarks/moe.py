"""Mixture of experts on one GPU: the Qwen3-30B-A3B shape (48 layers, hidden 2048, 128 experts, top 8,
expert intermediate 768, 32/4 heads of 128, vocabulary 151,936) with dummy bf16 weights drawn on the device
(`load_format="dummy"`: its 61 GB checkpoint fits no host disk), against ceilings measured in the same run.

- `offline_tok_s`: nano-vllm's offline workload, the draws of benchmarks/offline.py, through `tandem.LLM`.
- `decode_ms`: the decode step at batch 1, 8, 64 and 256 (512 tokens of context) under CUDA graphs, through
  the same engine; `decode_b1_floor_ms` the bytes a batch-1 step must read (attention weights, the router,
  the k experts of its one token, the LM head, its KV) over the copy bandwidth.
- `moe_gemm_tflops_b256`: the two grouped expert GEMMs of a batch-256 step (layer 0, CUDA-graph replays),
  with their bandwidth bound: at 256 tokens x top 8 over 128 experts each expert sees ~16 rows, so the
  GEMMs must read every expert's weights and cannot run faster than those bytes at the copy bandwidth.
  `moe_gemm_tflops_b256_bw_bound` is that rate, `moe_gemm_fraction_of_bw_bound` how close the kernels get;
  a few tile shapes are timed too (`moe_gemm_tile_sweep`). `matmul_tflops`: a large bf16 matmul.
- `moe_layer`: layer 0's whole MoE block at 1 and 8 tokens against the bytes it must read, times the layer
  count: how much of a decode step the routed experts take.

    python benchmarks/moe.py                              # H200: about 5 minutes, kernel builds included
    python benchmarks/moe.py --preset tiny --device cpu   # the same steps on a tiny shape, as a smoke test
    TRITON_INTERPRET=1 python benchmarks/moe.py --preset tiny --device cpu   # ...with the GEMM part too
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.benchmarks.common import RESULTS, call_timer, measure_ceilings, print_table, sync, write_result
from tandem.benchmarks.engine_steps import decode_batch, seconds_per_step
from tandem.benchmarks.offline import add_workload_args, pages_for, smoke_workload, workload, workload_config
from tandem.benchmarks.shapes import write_dummy_model
from tandem.engine.config import ModelConfig

QWEN3_30B_A3B: dict[str, Any] = {
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,  # unused: every layer is sparse
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,  # the workload's longest sequence is 2048 tokens
}
TINY: dict[str, Any] = {
    **QWEN3_30B_A3B,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 10240,  # the workload's ids go up to 10,000
}
PRESETS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY}
BATCHES = (1, 8, 64, 256)
# (BM, BN, BK, warps, stages) the batch-256 GEMMs are also timed with; the up GEMM takes a stage less.
SWEEP = ((16, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 64, 64, 4, 3), (32, 64, 256, 8, 3))
CONTEXT = 512


def decode_b1_bytes(c: ModelConfig, context: int, elem: int = 2) -> dict[str, int]:
    """What one batch-1 decode step must read, by part: every layer's attention weights (q/k/v and o) and
    norms, its router, the k experts its one token chose (gate, up and down), the LM head, the token's
    embedding row, and its KV at `context` tokens."""
    assert c.moe is not None
    m, h = c.moe, c.hidden_size
    attention = h * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * h
    norms = 2 * h + (2 * c.head_dim if c.qk_norm else 0)
    parts = {
        "attention_weights": c.num_layers * (attention + norms) * elem,
        "router": c.num_layers * m.num_experts * h * elem,
        "routed_experts": c.num_layers * m.top_k * 3 * h * m.expert_intermediate_size * elem,
        "lm_head": c.vocab_size * h * elem,
        "embedding_row": h * elem,
        "kv": c.num_layers * 2 * c.num_kv_heads * c.head_dim * context * elem,
    }
    parts["total"] = sum(parts.values())
    return parts


def expert_gemm_cost(c: ModelConfig, ids: torch.Tensor, elem: int = 2) -> dict[str, float]:
    """FLOPs of one layer's two grouped GEMMs for routing `ids` [T, k], and the bytes they cannot avoid:
    the weights of every expert some token chose, the tokens, the activation (written, then read) and the
    weighted rows they write."""
    assert c.moe is not None
    h, inter = c.hidden_size, c.moe.expert_intermediate_size
    pairs = ids.numel()
    hit = len(set(ids.flatten().tolist()))
    weights = hit * 3 * h * inter * elem
    activations = (ids.shape[0] * h + 2 * pairs * inter + pairs * h) * elem
    return {
        "flops": 2.0 * pairs * 3 * h * inter,
        "bytes": float(weights + activations),
        "experts_hit": hit,
        "rows_per_expert": pairs / c.moe.num_experts,
    }


def gemm_timings(llm: LLM, ceilings: dict[str, float], batch: int, sweep: bool) -> dict[str, Any]:
    """The grouped GEMMs of layer 0 at `batch` tokens against their bandwidth bound. On CPU they run only
    under TRITON_INTERPRET=1 (the smoke run's check that this code works), and their times mean nothing."""
    from tandem.engine.moe.fused import FusedMoE, GemmBlocks
    from tandem.engine.moe.layer import MoE

    engine = llm.runtime.engine
    device = engine.config.device
    layer = engine.model.model.layer(0).mlp
    if not isinstance(layer, MoE):
        return {"skipped": "layer 0 has no experts"}
    fused = layer.experts.fused
    if fused is None and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        fused = FusedMoE(layer.experts.spec, layer.shard, layer.experts.hidden_size)
    if fused is None:
        return {"skipped": "the fused MoE kernels run on CUDA (or, to test this script, interpreted)"}
    timer = call_timer(device)
    c = engine.model_config
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, c.hidden_size, generator=gen, device=device).to(engine.config.dtype)
    w13, w2 = layer.experts.w13, layer.experts.w2
    calls = 20 if device.type == "cuda" else 1
    with torch.inference_mode():
        logits = layer.gate(x)
        routing = fused.route(logits)
        cost = expert_gemm_cost(c, routing.ids.long())
        bound_s = cost["bytes"] / (ceilings["copy_bandwidth_GBps"] * 1e9)

        def timed(r: Any) -> float:
            # Resident MXFP4 or FP8 experts: their scales, so the kernels read the format they hold.
            scales = (layer.experts.w13_scales, layer.experts.w2_scales)
            block = layer.experts.fp8_block
            return timer(lambda i: fused.expert_gemms(x, r, w13, w2, scales=scales, fp8_block=block), calls)

        gemm_us = timed(routing)
        layer_us = timer(lambda i: layer(x), calls)
        sweep_rows = []
        if sweep:  # other tiles (each BM routes again: the schedule's blocks are BM rows)
            for bm, bn, bk, warps, stages in SWEEP:
                up = GemmBlocks(bm, bn, bk, 1, warps, max(2, stages - 1))
                down = GemmBlocks(bm, bn, bk, 1, warps, stages)
                us = timed(fused.route(logits, (up, down)))
                tiles = {"up": dataclasses.asdict(up), "down": dataclasses.asdict(down)}
                sweep_rows.append({**tiles, "us": us, "tflops": cost["flops"] / us / 1e6})
    tflops = cost["flops"] / gemm_us / 1e6
    bound_tflops = cost["flops"] / bound_s / 1e12
    return {
        "batch": batch,
        "gemm_us": gemm_us,
        "moe_layer_us": layer_us,
        "tflops": tflops,
        "bw_bound_tflops": bound_tflops,
        "fraction_of_bw_bound": tflops / bound_tflops,
        "bw_bound_us": bound_s * 1e6,
        "tiles": {"up": dataclasses.asdict(routing.up), "down": dataclasses.asdict(routing.down)},
        "tile_sweep": sweep_rows,
        **cost,
    }


def layer_timing(llm: LLM, ceilings: dict[str, float], batch: int) -> dict[str, Any]:
    """Layer 0's whole MoE block (router, top-k, experts, sum) at `batch` tokens in CUDA-graph replays,
    with the kernel plan of the decode graph of that batch (at batch 1: the router as a GEMV, every
    kernel launched with PDL), against the bytes it must read: the router and every expert its tokens
    chose. At batch 1 this is the share of the batch-1 step that the routed experts take (the rest is
    attention, norms, LM head)."""
    from tandem.engine.moe.layer import MoE

    engine = llm.runtime.engine
    device = engine.config.device
    layer = engine.model.model.layer(0).mlp
    if not isinstance(layer, MoE) or layer.experts.fused is None:
        return {"skipped": "the fused MoE kernels run on CUDA"}
    c = engine.model_config
    assert c.moe is not None
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(batch, c.hidden_size, generator=gen, device=device).to(engine.config.dtype)
    with torch.inference_mode():
        ids = torch.topk(layer.gate(x).float(), c.moe.top_k, dim=-1).indices
        plan = engine.planner.decode(batch)
        us = call_timer(device)(lambda i: layer(x, plan), 50)
    cost = expert_gemm_cost(c, ids)
    router_bytes = c.moe.num_experts * c.hidden_size * 2
    bound_us = (cost["bytes"] + router_bytes) / (ceilings["copy_bandwidth_GBps"] * 1e9) * 1e6
    return {"batch": batch, "plan": dataclasses.asdict(plan), "us": us, "bw_bound_us": bound_us,
            "fraction_of_bw_bound": bound_us / us, "experts_hit": cost["experts_hit"],
            "per_step_ms": us * c.num_layers / 1e3}  # fmt: skip


def decode_timings(llm: LLM, steps: int, batches: tuple[int, ...] = BATCHES) -> list[dict[str, Any]]:
    """ms per decode step of `llm`'s engine at each batch size, every row at CONTEXT tokens."""
    engine = llm.runtime.engine
    graphs = engine.decode_graphs
    rows = []
    for batch_size in batches:
        batch = decode_batch(engine, [CONTEXT] * batch_size)
        in_graph = graphs is not None and graphs.padded_size(batch) is not None
        ms = seconds_per_step(engine, batch, steps=steps) * 1e3
        rows.append({"batch": batch_size, "context": CONTEXT, "ms": ms, "cuda_graph": in_graph})
        print(f"decode batch {batch_size}: {ms:.3f} ms/step (CUDA graph: {in_graph})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    add_workload_args(parser)
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per repeat")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--no-sweep", action="store_true", help="skip the GEMM tile sweep")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    device = torch.device(args.device)
    if args.preset == "tiny":
        smoke_workload(args)
        args.steps = min(args.steps, 5)
    started = time.perf_counter()
    ceilings = measure_ceilings(device)
    model_dir = args.model_dir or Path(f"/tmp/tandem-bench/moe-{args.preset}")
    write_dummy_model(model_dir, "qwen3_moe", shape)
    prompts, params = workload(args)
    # Room for the workload at once, and for the largest decode batch's rows at CONTEXT.
    num_pages = max(pages_for(prompts, params), max(BATCHES) * -(-(CONTEXT + 1) // 16) + 64)
    start = time.perf_counter()
    llm = LLM(str(model_dir), device=args.device, load_format="dummy", page_size=16, num_pages=num_pages,
              max_running=args.max_running, chunk_size=args.chunk_size)  # fmt: skip
    init_s = time.perf_counter() - start
    engine = llm.runtime.engine
    print(f"engine in {init_s:.0f} s (graph capture {engine.capture_seconds:.0f} s)", flush=True)
    warm = SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True)
    llm.generate(prompts[:8], warm, use_tqdm=False)  # first-use kernel builds stay out of the timing
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    offline_s = time.perf_counter() - start
    output_tokens = sum(len(o.token_ids) for o in outs)
    assert output_tokens == sum(p.max_tokens for p in params), "ignore_eos runs produce every token"
    print(f"offline: {output_tokens / offline_s:.0f} output tok/s", flush=True)
    decode = decode_timings(llm, args.steps)
    c = engine.model_config
    floor = decode_b1_bytes(c, CONTEXT)
    floor_ms = floor["total"] / (ceilings["copy_bandwidth_GBps"] * 1e9) * 1e3
    gemm = gemm_timings(llm, ceilings, 256, sweep=not args.no_sweep)
    layers = [layer_timing(llm, ceilings, b) for b in (1, 8)] if device.type == "cuda" else []
    b1 = next(r["ms"] for r in decode if r["batch"] == 1)
    full = args.preset == "qwen3-30b-a3b" and device.type == "cuda"
    name = "moe-h200" if full else f"moe-{args.preset}-{device.type}"
    payload = {
        "config": {
            "model": f"Qwen3-MoE, {args.preset} shape, dummy bf16 weights (load_format='dummy')",
            "model_shape": shape,
            "workload": workload_config(args),
            "max_running": args.max_running,
            "chunk_size": args.chunk_size,
            "num_pages": num_pages,
            "decode_context": CONTEXT,
            "decode_steps_per_repeat": args.steps,
            "switches": engine.config.switches(),
        },
        "ceilings": ceilings,
        "matmul_tflops": ceilings["bf16_matmul_TFLOPs"],
        "offline_tok_s": output_tokens / offline_s,
        "offline": {"elapsed_s": offline_s, "output_tokens": output_tokens},
        "decode_b1_ms": b1,
        "decode_b1_floor_ms": floor_ms,
        "decode_b1_over_floor": b1 / floor_ms,
        "decode_b1_floor_bytes": floor,
        "decode_ms": decode,
        "moe_gemm_tflops_b256": gemm.get("tflops"),
        "moe_gemm_tflops_b256_bw_bound": gemm.get("bw_bound_tflops"),
        "moe_gemm_fraction_of_bw_bound": gemm.get("fraction_of_bw_bound"),
        "moe_gemm_b256": gemm,
        "moe_layer": layers,
        "targets": {
            "decode_b1_ms <= 1.6 x decode_b1_floor_ms": b1 <= 1.6 * floor_ms,
            "moe_gemm_tflops_b256 >= matmul_tflops / 2": None
            if gemm.get("tflops") is None
            else gemm["tflops"] >= ceilings["bf16_matmul_TFLOPs"] / 2,
            "moe_gemm_tflops_b256_bw_bound >= matmul_tflops / 2 (reachable at all)": None
            if gemm.get("bw_bound_tflops") is None
            else gemm["bw_bound_tflops"] >= ceilings["bf16_matmul_TFLOPs"] / 2,
        },
        "engine_init_s": init_s,
        "graph_capture_s": engine.capture_seconds,
        "total_s": time.perf_counter() - started,
    }
    llm.shutdown()
    path = write_result(name, payload, device=device, out_dir=args.out_dir)
    print(f"\n{path}  ({ceilings})")
    print(
        f"offline {payload['offline_tok_s']:.0f} tok/s; decode b1 {b1:.3f} ms, floor {floor_ms:.3f} ms "
        f"({b1 / floor_ms:.2f}x); MoE GEMMs at b256 {gemm.get('tflops')} TFLOP/s, bandwidth bound "
        f"{gemm.get('bw_bound_tflops')} TFLOP/s; matmul {ceilings['bf16_matmul_TFLOPs']} TFLOP/s"
    )
    print_table(decode, ["batch", "context", "ms", "cuda_graph"])


if __name__ == "__main__":
    main()
