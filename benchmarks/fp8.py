"""FP8 against bf16 on the Llama-3.1-8B shape (random weights): the batch-1 decode step (decode graphs, 512
tokens of context, through the Engine as decode.py times it), offline throughput (offline.py's workload)
and greedy top-1 agreement with bf16 over 1,000 teacher-forced positions, for dynamic per-channel FP8
(`quantization="fp8"`) and, reported beside it, a block-scaled (128 x 128) FP8 checkpoint (each on the GEMM
the engine picks: flashinfer's block-scaled GEMM on Hopper, see engine/quant/fp8_linear.py).

    python benchmarks/fp8.py --parts decode,top1          # then, in a second call:
    python benchmarks/fp8.py --parts offline
Each call updates <out-dir>/fp8-<device tag>.json (keys device, commit, decode_b1_ms_bf16,
decode_b1_ms_fp8, offline_tok_s_bf16, offline_tok_s_fp8, top1_agreement, top1_agreement_block).

Random weights give flat logits: bf16's top two choices are often a fraction of a nat apart, and any
rounding flips such a tie. So agreement is also reported where bf16's choice leads by at least
`CLEAR_LEAD_NATS` (`top1_agreement_clear`, `top1_agreement_block_clear`), which is FP8's own error.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import RESULTS, device_info, git_commit, release_memory, sync
from tandem.benchmarks.engine_steps import PAGE, build_engine, decode_batch, seconds_per_step
from tandem.benchmarks.shapes import LLAMA_3_1_8B, write_random_model
from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch
from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.models.context import ForwardContext
from tandem.engine.streams import StreamSet

MODES: dict[str, dict[str, Any]] = {"bf16": {}, "fp8": {"quantization": "fp8"}}


def decode_b1(model_dir: Path, device: torch.device, context: int, steps: int) -> dict[str, float]:
    out = {}
    for mode, options in MODES.items():
        engine = build_engine(
            model_dir,
            device,
            num_pages=-(-(context + 1) // PAGE) + 64,
            cuda_graph=True,
            max_bs=1,
            options=options,
        )
        out[f"decode_b1_ms_{mode}"] = (
            seconds_per_step(engine, decode_batch(engine, [context]), steps=steps) * 1e3
        )
        if options:
            out["fp8_gemm"] = engine.config.fp8_gemm  # which GEMM the FP8 layers ran
        print(f"{mode}: {out[f'decode_b1_ms_{mode}']:.3f} ms per batch-1 decode step", flush=True)
        del engine
        release_memory()
    return out


def offline(model_dir: Path, device: torch.device) -> dict[str, float]:
    from tandem.benchmarks.offline import pages_for, run_one, workload

    args = argparse.Namespace(
        num_seqs=256, min_input=100, max_input=1024, min_output=100, max_output=1024,
        device=str(device), max_running=256, chunk_size=8192, num_pages=0,
    )  # fmt: skip
    prompts, params = workload(args)
    args.num_pages = pages_for(prompts, params)
    out = {}
    for mode, options in MODES.items():
        run = run_one(model_dir, options, prompts, params, args)
        out[f"offline_tok_s_{mode}"] = run["output_tok_per_s"]
        print(f"{mode}: {run['output_tok_per_s']:.0f} output tok/s", flush=True)
        release_memory()
    return out


CLEAR_LEAD_NATS = 0.5  # bf16's top choice leads its runner-up by this much log-probability


def _top1(model_dir: Path, device: torch.device, ids: torch.Tensor, **options: Any) -> torch.Tensor:
    """[positions, 2]: the argmax and its lead over the runner-up in log-probability (nats) at every
    position of one teacher-forced prefill of `ids` (eager, no graphs)."""
    n = ids.shape[0]
    pages = -(-n // PAGE)
    config = resolve_engine_config(
        model_dir, device=str(device), page_size=PAGE, num_pages=pages + 8,
        cuda_graph=False, piecewise_cuda_graph=False, **options,
    )  # fmt: skip
    engine = Engine(config, TPGroup(), StreamSet(config.device))
    table = torch.arange(1, pages + 1, dtype=torch.int32).unsqueeze(0)
    pos = torch.arange(n)
    loc = (table[0].long()[pos // PAGE] * PAGE + pos % PAGE).to(device)
    zero = torch.zeros(1, dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    group = AttentionGroupBatch(table.to(device), zero.to(device), loc, zero, table)
    batch = ForwardBatch(
        ids.to(device), pos.to(device), lens.to(device), lens.to(device), lens, lens,
        (group,) * len(engine.groups), SamplingBatch.greedy(1, device), False,
    )  # fmt: skip
    with torch.inference_mode():
        engine.attention.plan(batch)
        hidden = engine.model(batch.input_ids, batch.positions, ForwardContext(engine.attention, engine.pool))
        top = torch.cat([_lead(engine.model.compute_logits(h)) for h in hidden.split(256)]).cpu()
    del engine
    release_memory()
    return top


def _lead(logits: torch.Tensor) -> torch.Tensor:
    best = logits.float().log_softmax(-1).topk(2, dim=-1)
    return torch.stack([best.indices[:, 0].float(), best.values[:, 0] - best.values[:, 1]], dim=-1)


def top1(model_dir: Path, device: torch.device, positions: int, block_dir: Path) -> dict[str, float]:
    from tandem.engine.quant.fp8_export import write_fp8_checkpoint

    ids = torch.randint(3, 10000, (positions,), generator=torch.Generator().manual_seed(0))
    reference = _top1(model_dir, device, ids)
    fp8 = _top1(model_dir, device, ids, quantization="fp8")
    if not (block_dir / "config.json").is_file():
        write_fp8_checkpoint(model_dir, block_dir, layout="block", block=(128, 128))
    block = _top1(block_dir, device, ids)
    # A random model's logits are flat: at most positions bf16's own top two are a fraction of a nat
    # apart, and any rounding flips them. Agreement where bf16's choice is clear separates FP8's error
    # from that.
    clear = reference[:, 1] >= CLEAR_LEAD_NATS
    out = {
        "top1_agreement": float((fp8[:, 0] == reference[:, 0]).float().mean()),
        "top1_agreement_block": float((block[:, 0] == reference[:, 0]).float().mean()),
        "top1_positions": positions,
        "top1_agreement_clear": float((fp8[clear, 0] == reference[clear, 0]).float().mean()),
        "top1_agreement_block_clear": float((block[clear, 0] == reference[clear, 0]).float().mean()),
        "clear_positions": int(clear.sum()),
        "clear_lead_nats": CLEAR_LEAD_NATS,
        "bf16_lead_nats_median": float(reference[:, 1].median()),
    }
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="decode,top1,offline")
    parser.add_argument("--layers", type=int, default=LLAMA_3_1_8B["num_hidden_layers"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--positions", type=int, default=1000)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", default="fp8-h200")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = {**LLAMA_3_1_8B, "num_hidden_layers": args.layers}
    model_dir = write_random_model(
        args.model_dir or Path(f"/tmp/tandem-bench/llama-8b-{args.layers}l"), "llama", device=device, **shape
    )
    path = args.out_dir / f"{args.name}.json"
    record: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    record.update(device=device_info(device), commit=git_commit())
    record.setdefault("config", {}).update(
        model="Llama-3.1-8B shape, random bf16 weights", layers=args.layers, context=args.context,
        fp8="dynamic FP8, per-channel weight scales (quantization='fp8')",
        fp8_block="a 128 x 128 block-scaled checkpoint",
    )  # fmt: skip
    start = time.perf_counter()
    parts = args.parts.split(",")
    if "decode" in parts:
        record.update(decode_b1(model_dir, device, args.context, args.steps))
    if "top1" in parts:
        record.update(
            top1(model_dir, device, args.positions, model_dir.with_name(model_dir.name + "-fp8-block"))
        )
    if "offline" in parts:
        record.update(offline(model_dir, device))
    sync(device)
    if "decode_b1_ms_bf16" in record and "decode_b1_ms_fp8" in record:
        record["decode_b1_fp8_over_bf16"] = record["decode_b1_ms_fp8"] / record["decode_b1_ms_bf16"]
    if "offline_tok_s_bf16" in record and "offline_tok_s_fp8" in record:
        record["offline_fp8_over_bf16"] = record["offline_tok_s_fp8"] / record["offline_tok_s_bf16"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{path} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
