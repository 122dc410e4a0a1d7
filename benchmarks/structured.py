"""Structured outputs' cost: the offline workload (offline.py's 256 requests) with every other request
under a small JSON schema, then the same requests plain, on the same engine.

A random-weight model completes the schema's object now and then, so constrained rows may stop before
max_tokens. Each plain run therefore gives every request the output length it had in the mixed run just
before it: the two make the same tokens in the same rows, and their ratio of output tokens/s (mixed /
plain) is the constraints' cost alone. A mixed pass that the figures leave out comes first: it pays the
one-time costs of a first pass at full size (allocator and pinned-buffer growth, kernel variants), which
would otherwise land on the first timed run. The pairs repeat `--repeats` times; the figures are their
means. Also reported, for the requests without a schema in the mixed run (the same ones in both kinds of
run): their mean time per output token (TPOT: first to last token of each, over its tokens after the
first) and time to first token in every run, so a slowdown of the unconstrained rows shows against the
spread between runs; and the bitmask fill timed alone (`mask_fill`) on matchers replayed to where the
constrained rows ended.

    python benchmarks/structured.py                      # on the GPU: results/structured-h200.json
    python benchmarks/structured.py --num-seqs 8 --min-input 16 --max-input 64 --min-output 8 \
        --max-output 32 --layers 1 --device cpu \
        --model-dir /tmp/tandem-bench/qwen3-1l --tag smoke --out-dir /tmp
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from tandem import LLM, SamplingParams
from tandem.benchmarks.common import RESULTS, release_memory, sync, write_result
from tandem.benchmarks.offline import add_workload_args, pages_for, workload
from tandem.benchmarks.shapes import QWEN3_0_6B, write_random_model
from tandem.scheduler.messages import GrammarSpec, TokenOutput
from tandem.scheduler.sampling_params import StructuredOutputs
from tandem.scheduler.structured.grammar import (
    BitmaskFiller,
    GrammarState,
    compile_spec,
    hf_tokenizer_info,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "score": {"type": "number"},
        "values": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "score", "values"],
}


def timed_generate(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], plain: list[int]
) -> dict[str, Any]:
    """One timed run; per-request token times are taken where the scheduler emits its outputs. TPOT and
    TTFT are over the requests `plain`: those plain in both kinds of run, so both average the same rows."""
    results = llm.runtime.scheduler.results
    emit = results.emit
    first_rid = llm._next_rid  # generate numbers the requests from here, in order
    times: dict[int, list[float]] = {}
    steps: list[tuple[float, int]] = []  # per batch with tokens: when processed, and how many

    def recording(outs: list[TokenOutput]) -> None:
        now = time.perf_counter()
        rows = 0
        for out in outs:
            if out.token_id is not None:
                times.setdefault(out.rid, []).append(now)
                rows += 1
        if rows:  # not a finish on its own
            steps.append((now, rows))
        emit(outs)

    results.emit = recording
    timer = llm.runtime.scheduler.timer
    timer.reset()
    try:
        sync(llm.runtime.engine.config.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm.runtime.engine.config.device)
        elapsed = time.perf_counter() - start
    finally:
        results.emit = emit
    tokens = sum(len(o.token_ids) for o in outs)
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for i in plain if len(t := times.get(first_rid + i, [])) > 1]
    ttfts = [t[0] - start for i in plain if (t := times.get(first_rid + i))]
    constrained = [o for o, p in zip(outs, params) if p.structured_outputs is not None]
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
        "plain_tpot_ms": 1e3 * sum(tpots) / max(len(tpots), 1),
        "plain_ttft_ms": 1e3 * sum(ttfts) / max(len(ttfts), 1),  # from the run's start
        "constrained_requests": len(constrained),
        "constrained_tokens": sum(len(o.token_ids) for o in constrained),
        "constrained_finish_reasons": sorted({str(o.finish_reason) for o in constrained}),
        "lengths": [len(o.token_ids) for o in outs],
        "steps": [(t - start, rows) for t, rows in steps],
        "constrained_outputs": [list(o.token_ids) for o in constrained],
        # Loop phases (scheduler/step_timer.py); `masked_sample` is the constrained batches' sample,
        # run after the previous batch's results.
        "step_phases": timer.summary(),
    }


def step_bands(mixed: list[tuple[float, int]], plain: list[tuple[float, int]]) -> list[dict[str, float]]:
    """Mean step time of a mixed run and of the plain run after it, by ranges of the step's index (the
    two make the same tokens in the same rows, step by step), with the rows that made a token: where, from
    the prefill-heavy first steps to the tail of long rows, the constrained rows cost time."""
    count = min(len(mixed), len(plain))
    edges = sorted({0, count, *(e for e in (10, 50, 200, 400, 600, 800, 900, 1000) if e < count)})
    bands = []
    for lo, hi in itertools.pairwise(edges):
        spans = [(run[hi - 1][0] - (run[lo - 1][0] if lo else 0.0)) / (hi - lo) for run in (mixed, plain)]
        bands.append(
            {
                "steps": f"{lo}-{hi}",
                "rows": round(sum(rows for _, rows in plain[lo:hi]) / (hi - lo), 1),
                "mixed_ms": round(1e3 * spans[0], 3),
                "plain_ms": round(1e3 * spans[1], 3),
            }
        )
    return bands


def _mean(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("output_tok_per_s", "plain_tpot_ms", "plain_ttft_ms", "output_tokens")
    return {key: sum(run[key] for run in runs) / len(runs) for key in keys}


def mask_fill(llm: LLM, outputs: list[list[int]], repeats: int = 20) -> dict[str, Any]:
    """The bitmask fill of one step timed alone: one matcher per constrained output, replayed through a
    random share of its tokens (mid-object states, as in the run), filled by the scheduler's filler."""
    rng = random.Random(0)
    tokenizer = llm.tokenizer
    info = hf_tokenizer_info(tokenizer, (tokenizer.eos_token_id,))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled: Future[xgr.CompiledGrammar] = Future()
    compiled.set_result(compile_spec(compiler, GrammarSpec("json_schema", json.dumps(SCHEMA))))
    states = []
    for tokens in outputs:
        state = GrammarState(compiled)
        for token in tokens[: rng.randint(0, max(len(tokens) - 1, 0))]:
            if not state.accept(token) or state.terminated:
                break
        states.append(state)
    out: dict[str, Any] = {
        "rows": len(states),
        "cpus": {"os.cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))},
    }
    for name, threads in (("filler", 1), ("two_threads", 2), ("xgrammar_auto", "auto")):
        filler = BitmaskFiller(threads=threads)
        filler.fill(states)
        start = time.perf_counter()
        for _ in range(repeats):
            filler.fill(states)
        out[f"ms_per_fill_{name}"] = round(1e3 * (time.perf_counter() - start) / repeats, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each kind, alternating")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem-bench/qwen3-0.6b-covering"))
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--tag", default="h200", help="result file: structured-<tag>.json")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    device = torch.device(args.device)
    shape = {**QWEN3_0_6B, "num_hidden_layers": args.layers}
    # A tokenizer with text for all 151,936 ids, as Qwen's has: the masks' cost is the vocabulary's.
    model_dir = write_random_model(args.model_dir, "qwen3", device=device, covering_tokenizer=True, **shape)
    prompts, plain_params = workload(args)
    schema = StructuredOutputs(json=SCHEMA)
    mixed_params = [replace(p, structured_outputs=schema) if i % 2 else p for i, p in enumerate(plain_params)]
    options: dict[str, Any] = {
        "device": args.device,
        "page_size": 16,
        "num_pages": pages_for(prompts, plain_params),
        "max_running": args.max_running,
        "chunk_size": args.chunk_size,
        # Every run prefills its prompts in full, as offline.py's single run does: with the radix cache
        # on, every run after the first would find its prompts cached.
        "prefix_cache": False,
    }
    llm = LLM(str(model_dir), **options)
    # Build both paths' kernels, the schema's compile and xgrammar's tokenizer info.
    warm = SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True)
    llm.generate(prompts[:8], [warm, replace(warm, structured_outputs=schema)] * 4, use_tqdm=False)
    # A full pass first, left out of the figures: the one-time costs of a first pass at full size
    # (allocator and pinned buffer growth, kernel variants) would otherwise land on the first timed run.
    plain_rows = [i for i, p in enumerate(mixed_params) if p.structured_outputs is None]
    first = timed_generate(llm, prompts, mixed_params, plain_rows)
    first.pop("lengths")
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "mixed": []}
    for _ in range(args.repeats):
        mixed_run = timed_generate(llm, prompts, mixed_params, plain_rows)
        lengths = mixed_run.pop("lengths")
        plain_run = timed_generate(
            llm, prompts, [replace(p, max_tokens=n) for p, n in zip(plain_params, lengths)], plain_rows
        )
        plain_run.pop("lengths")
        runs["mixed"].append(mixed_run)
        runs["plain"].append(plain_run)
    fill = mask_fill(llm, first.pop("constrained_outputs"))
    bands = step_bands(runs["mixed"][0]["steps"], runs["plain"][0]["steps"])
    for run in [first, *runs["plain"], *runs["mixed"]]:
        run.pop("steps")
    for run in runs["plain"] + runs["mixed"]:
        run.pop("constrained_outputs")
    llm.shutdown()
    release_memory()
    plain, mixed = (_mean(runs[kind]) for kind in ("plain", "mixed"))
    ratio = mixed["output_tok_per_s"] / plain["output_tok_per_s"]
    payload = {
        "plain_tok_s": plain["output_tok_per_s"],
        "mixed_tok_s": mixed["output_tok_per_s"],
        "ratio": ratio,
        "plain_tpot_ms": {
            "plain_run": plain["plain_tpot_ms"],
            "mixed_run": mixed["plain_tpot_ms"],
            "plain_runs": [run["plain_tpot_ms"] for run in runs["plain"]],
            "mixed_runs": [run["plain_tpot_ms"] for run in runs["mixed"]],
        },
        # Mean time from a run's start to each plain request's first token: with the TPOT, where a plain
        # row's time goes.
        "plain_ttft_ms": {"plain_run": plain["plain_ttft_ms"], "mixed_run": mixed["plain_ttft_ms"]},
        "config": {
            "model": "Qwen3-0.6B shape, random bf16 weights",
            "tokenizer": "the tiny tokenizer widened to the head's 151,936 ids (engine/tiny/tokenizer.py)",
            "model_shape": shape,
            "num_seqs": args.num_seqs,
            "input_len": [args.min_input, args.max_input],
            "output_len": [args.min_output, args.max_output],
            "constrained": "every other request (odd indices)",
            "lengths": "each plain run gives every request its output length in the mixed run just before",
            "order": f"an untimed mixed pass, then mixed and plain {args.repeats} times; figures are means",
            "schema": SCHEMA,
            "temperature": 0.6,
            "ignore_eos": True,
            **options,
        },
        "runs": {"warm_up": first, **runs},
        "step_bands": {"pair": "the first mixed run and the plain run after it", "bands": bands},
        "mask_fill": fill,
    }
    path = write_result(f"structured-{args.tag}", payload, device=device, out_dir=args.out_dir)
    print(
        f"{path}: plain {plain['output_tok_per_s']:.0f} tok/s, mixed {mixed['output_tok_per_s']:.0f} tok/s, "
        f"ratio {ratio:.3f}; plain rows' TPOT (ms) in the plain runs"
        f" {[round(r['plain_tpot_ms'], 3) for r in runs['plain']]}, in the mixed runs"
        f" {[round(r['plain_tpot_ms'], 3) for r in runs['mixed']]}; their mean TTFT"
        f" {plain['plain_ttft_ms']:.1f} -> {mixed['plain_ttft_ms']:.1f} ms;"
        f" mask fill {fill['ms_per_fill_filler']:.2f} ms for {fill['rows']} rows"
    )


if __name__ == "__main__":
    main()
