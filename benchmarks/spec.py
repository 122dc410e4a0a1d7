"""Speculative decoding's machinery at known acceptance: a Llama-3.1-8B-shaped model with dummy weights,
whose drafts come from a REPLAY drafter (this benchmark's, not a shipped method): the target's own next
greedy tokens (recorded by a plain run first), each replaced at random with probability p by a token it is
not. Random weights accept nothing real, so p sets the acceptance: with K drafts the expected tokens per
drafted row are 1 + sum_{i=1..K} (1 - p)^i, and p is solved for 1, 2, 3 and 4 of them.

For each mean accepted length L and batch b in (1, 32): `accept_len_L.b{b}_ratio`, the wall ms per output
token of one stream with drafts over the same without (`speculative: false` on the same engine, in the
same run), with the raw times and the measured L beside it. `zero_accept_overhead`: the same ratio at
batch 1 with drafts that are always wrong (L = 1). And n-gram (prompt lookup) on the demo model, whose
answers recite its training text, so its drafts really hit.

    python benchmarks/spec.py                 # H200: writes benchmarks/results/spec-h200.json
    python benchmarks/spec.py --smoke --out-dir /tmp/spec    # CPU, tiny shapes: what the test runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.benchmarks.common import RESULTS, print_table, release_memory, sync, write_result
from tandem.benchmarks.shapes import LLAMA_3_1_8B
from tandem.engine.tiny import default_model_dir, load_tiny_tokenizer, tiny_config
from tandem.replicas.request_output import RequestOutput
from tandem.scheduler.request import Request
from tandem.scheduler.spec.decoding import SpecDecoding

TINY_LLAMA: dict[str, Any] = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "vocab_size": 512, "max_position_embeddings": 512}  # fmt: skip
ACCEPT_LENGTHS = (1, 2, 3, 4)


def replace_probability(length: float, k: int) -> float:
    """p such that a drafted row emits `length` tokens on average: sum_{i=1..k} (1 - p)^i = length - 1."""
    if length <= 1:
        return 1.0
    lo, hi = 0.0, 1.0  # on q = 1 - p; the sum grows with q
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**i for i in range(1, k + 1)) < length - 1 else (lo, q)
    return 1.0 - (lo + hi) / 2


class ReplayDrafts(SpecDecoding):
    """Drafts that replay `reference` (each prompt's greedy continuation), each token replaced with
    probability `p` by another id. The schedule asks only for rows whose earlier drafts are verified, so
    `device_len` is exact here and names the output index of the first draft."""

    def __init__(self, base: SpecDecoding, reference: dict[tuple[int, ...], list[int]], p: float) -> None:
        super().__init__(base.config, base.max_seq_len, vocab_size=base.vocab_size)
        self.reference = reference
        self.p = p
        self.rng = np.random.default_rng(0)

    def drafts(self, req: Request) -> tuple[int, ...] | None:
        if not req.sampling.speculative:
            return ()
        total = min(req.prompt_len + req.sampling.max_tokens, self.max_seq_len)
        k = min(self.config.num_speculative_tokens, total - req.device_len - 1)
        at = req.device_len - req.prompt_len
        ref = np.array(self.reference[tuple(req.prompt_ids)][at : at + max(k, 0)], dtype=np.int64)
        if not len(ref):
            return ()
        other = (ref + 1 + self.rng.integers(0, self.vocab_size - 1, len(ref))) % self.vocab_size
        return tuple(np.where(self.rng.random(len(ref)) < self.p, other, ref).tolist())


def ngram(k: int) -> dict[str, Any]:
    """The engine's speculative_config: n-gram, which the replay drafter then stands in for."""
    return {"method": "ngram", "num_speculative_tokens": k}


def install(llm: LLM, spec: SpecDecoding) -> None:
    """Put `spec` where the rank's scheduler and launcher look for their drafter (one rank, in process)."""
    scheduler = llm.runtime.scheduler
    scheduler.spec = spec
    scheduler.launcher.spec = spec


def timed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int
) -> tuple[float, list[RequestOutput]]:
    """Median wall ms per output token of one stream (every request emits max_tokens), and the outputs;
    after one untimed run of the same work."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        sync(llm.runtime.streams.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm.runtime.streams.device)
        times.append((time.perf_counter() - start) * 1e3 / params.max_tokens)
    return statistics.median(times), outs


def replay_sweep(llm: LLM, args: argparse.Namespace, batches: Sequence[int]) -> dict[str, Any]:
    """Plain decode, then each acceptance length, at each batch size; the reference from the plain runs."""
    base = llm.runtime.scheduler.spec
    assert base is not None
    rng = np.random.default_rng(1)
    vocab = base.vocab_size
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, speculative=False)
    drafted = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"plain": {}}
    runs: dict[int, tuple[list[list[int]], dict[tuple[int, ...], list[int]]]] = {}
    for b in batches:
        prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(b)]
        ms, outs = timed(llm, prompts, plain, args.repeats)
        out["plain"][f"b{b}_ms_per_token"] = ms
        runs[b] = prompts, {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}
        print(f"plain b{b}: {ms:.3f} ms/token", flush=True)
    for length in ACCEPT_LENGTHS:
        p = replace_probability(length, args.k)
        row: dict[str, Any] = {"p": round(p, 4), "target_accept_len": length}
        for b in batches:
            prompts, reference = runs[b]
            replay = ReplayDrafts(base, reference, p)
            install(llm, replay)
            ms, outs = timed(llm, prompts, drafted, args.repeats)
            install(llm, base)
            exact = all(o.token_ids == reference[tuple(q)] for q, o in zip(prompts, outs, strict=True))
            row[f"b{b}_ms_per_token"] = ms
            row[f"b{b}_ratio"] = ms / out["plain"][f"b{b}_ms_per_token"]
            row[f"b{b}_accept_len"] = replay.stats()["spec_decode_mean_acceptance_length"]
            row[f"b{b}_output_equals_plain"] = exact
            print(f"L={length} b{b}: {ms:.3f} ms/token, ratio {row[f'b{b}_ratio']:.3f}, "
                  f"measured L {row[f'b{b}_accept_len']:.2f}", flush=True)  # fmt: skip
        out[f"accept_len_{length}"] = row
    one = out["accept_len_1"]  # p = 1: every draft is wrong
    out["zero_accept_overhead"] = one[f"b{batches[0]}_ratio"]
    out[f"zero_accept_overhead_b{batches[-1]}"] = one[f"b{batches[-1]}_ratio"]
    return out


def ngram_demo(device: str, k: int, tokens: int, repeats: int) -> dict[str, Any]:
    """Prompt lookup on the demo model, one stream reciting its training text: ms per token over plain."""
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    passage = tok((model_dir.parent / "corpus.txt").read_text()[:600])["input_ids"]
    prompts = [passage + passage[:16]]
    llm = LLM(str(model_dir), device=device, speculative_config=ngram(k))
    plain = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, speculative=False)
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    plain_ms, want = timed(llm, prompts, plain, repeats)
    before = llm.stats()
    spec_ms, got = timed(
        llm, prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), repeats
    )
    after = llm.stats()
    llm.shutdown()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return {
        "plain_ms_per_token": plain_ms,
        "ngram_ms_per_token": spec_ms,
        "b1_ratio": spec_ms / plain_ms,
        "accept_len": 1 + accepted / drafts if drafts else 0.0,
        "output_equals_plain": [o.token_ids for o in got] == [o.token_ids for o in want],
    }


def write_llama(path: Path, shape: dict[str, Any]) -> Path:
    """config.json and the tiny tokenizer; the engine draws the weights (load_format="dummy")."""
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config("llama", **shape)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    load_tiny_tokenizer().save_pretrained(path)
    return path


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, few tokens: the test's run")
    parser.add_argument("--device", default=None, help="default cuda (smoke: cpu)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument(
        "--name", default=None, help="result file name (default spec-h200; smoke: spec-smoke)"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompt_len, args.tokens, args.repeats = min(args.prompt_len, 12), min(args.tokens, 12), 1
        args.batches = "1,2" if args.batches == "1,32" else args.batches
    device = args.device or ("cpu" if args.smoke else "cuda")
    shape = TINY_LLAMA if args.smoke else LLAMA_3_1_8B
    model_dir = write_llama(
        args.model_dir or Path(f"/tmp/tandem-bench/spec-{'tiny' if args.smoke else '8b'}"), shape
    )
    batches = [int(b) for b in args.batches.split(",")]
    per_request = args.prompt_len + args.tokens + args.k + 1
    pages = max(batches) * -(-per_request // 16) + 64
    started = time.perf_counter()
    llm = LLM(str(model_dir), device=device, load_format="dummy", page_size=16, num_pages=pages,
              max_running=max(batches), speculative_config=ngram(args.k))  # fmt: skip
    switches = llm.runtime.engine.config.switches()
    results = replay_sweep(llm, args, batches)
    llm.shutdown()
    del llm
    release_memory()
    results["ngram_demo_model"] = ngram_demo(device, args.k, args.tokens, args.repeats)
    path = write_result(
        args.name or ("spec-smoke" if args.smoke else "spec-h200"),
        {
            "config": {
                "model": "Llama-3.1-8B shape, dummy weights"
                if not args.smoke
                else "tiny Llama, dummy weights",
                "model_shape": shape,
                "num_speculative_tokens": args.k,
                "batches": batches,
                "prompt_len": args.prompt_len,
                "output_tokens": args.tokens,
                "repeats": args.repeats,
                "drafter": "replay: the target's greedy tokens, each replaced with probability p",
                "ratio": "wall ms per output token of a stream with drafts / without, same engine and run",
                "switches": switches,
            },
            "wall_s": time.perf_counter() - started,
            **results,
        },
        device=torch.device(device),
        out_dir=args.out_dir,
    )
    rows = [{"L": n, **{k: v for k, v in results[f"accept_len_{n}"].items() if "ratio" in k or "len" in k}}
            for n in ACCEPT_LENGTHS]  # fmt: skip
    print(f"\n{path}")
    print_table(rows, list(rows[0]))
    return path


if __name__ == "__main__":
    main()
