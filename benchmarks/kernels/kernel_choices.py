"""Kernel choices for the decode step, each measured on its own inside a CUDA graph (GPU only).

The decode profile (decode_profile.py) says where a step's time goes; this says which alternative
to pick for each part, on the shapes of the two speed targets (Llama-3.1-8B decode at batch 1-64,
Qwen3-0.6B offline at batch up to 256):

- attention: flashinfer's tensor-core decode (the fa2 prefill kernel) against its CUDA-core decode
  kernel, each with the default KV split, no split, and fixed splits, in graph-mode plans;
- act (act_variants.py): flashinfer's SiLU-and-multiply against a candidate Triton kernel;
- norm (norm_variants.py): flashinfer's fused add + RMS norm against a Triton kernel of one program a row;
- decode_fused (decode_fused_variants.py): the rope with the K/V store then flashinfer's decode, against
  the one-launch small-batch decode (engine/attention/triton_decode.py) at several splits and block sizes;
- KV store: two `index_put`s (K then V) against flashinfer's `append_paged_kv_cache` (one kernel);
- weight GEMMs (gemm_variants.py): cuBLAS against cuBLASLt (torch's preferred BLAS library), the other
  weight layout, flashinfer's small-M kernel and a Triton candidate, against copy bandwidth;
- chain (layer_chain.py): a whole small-batch decode layer in a graph (Llama-3.1-8B, Qwen3-0.6B), with
  the Triton activation, tinygemm or the Triton GEMV for the GEMMs, and programmatic dependent launch;
- sampling at temperature 0.6: tandem's torch path against flashinfer's fused `sampling_from_logits`,
  and the sampler from bf16 logits with flashinfer's draw against the one-pass Triton race
  (engine/sampling_race.py); the race with every other row under a structured-output mask, and over
  those rows alone.

Every figure is µs per call from CUDA-graph replays over enough distinct buffers that L2 serves none
of them (sampling: kernel time from the profiler).

    python benchmarks/kernel_choices.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import (
    RESULTS,
    graph_us,
    measure_ceilings,
    print_table,
    release_memory,
    write_result,
)
from tandem.benchmarks.engine_steps import sampling
from tandem.benchmarks.kernels.decode_fused_variants import decode_fused_rows
from tandem.benchmarks.kernels.gemm_variants import GEMM_LIBS, gemm_rows
from tandem.benchmarks.kernels.layer_chain import chain_rows
from tandem.benchmarks.kernels.norm_variants import norm_rows
from tandem.benchmarks.kernels.paged_case import BF16, HEAD_DIM, PAGE, PagedCase
from tandem.benchmarks.kernels.qk_norm_rope_variants import qk_norm_rope_rows
from tandem.engine.sampler import Sampler, race_keys

LLAMA = {
    "name": "llama-8b",
    "head_dim": HEAD_DIM,
    "heads": 32,
    "kv_heads": 8,
    "hidden": 4096,
    "inter": 14336,
    "vocab": 128256,
}
GEMMA3_1B = {"name": "gemma-3-1b", "head_dim": 256, "heads": 4, "kv_heads": 1}
QWEN = {
    "name": "qwen3-0.6b",
    "head_dim": HEAD_DIM,
    "heads": 16,
    "kv_heads": 8,
    "hidden": 1024,
    "inter": 3072,
    "vocab": 151936,
}


ATTENTION_VARIANTS: list[tuple[str, bool, dict[str, Any]]] = [
    ("tc", True, {}),
    ("tc-nosplit", True, {"disable_split_kv": True}),
    ("tc-split8", True, {"fixed_split_size": 8}),
    ("tc-split32", True, {"fixed_split_size": 32}),
    ("cc", False, {}),
    ("cc-nosplit", False, {"disable_split_kv": True}),
    # flashinfer's Hopper kernels (TMA, wgmma) for the tensor-core path; a separate JIT build.
    ("tc-fa3", True, {"backend": "fa3"}),
]


def attention_rows(
    shape: dict[str, Any], bs: int, ctx: int, layers: int, bandwidth: float, only: set[str] | None = None
) -> list[dict[str, Any]]:
    import flashinfer

    case = PagedCase(shape["kv_heads"], bs, ctx, layers)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    q = torch.randn(bs, shape["heads"], HEAD_DIM, dtype=BF16, device="cuda")
    out = torch.empty_like(q)
    row: dict[str, Any] = {"part": "attention", "model": shape["name"], "bs": bs, "ctx": ctx}
    reference = None
    variants = [v for v in ATTENTION_VARIANTS if only is None or v[0] in only]
    for name, tensor_cores, variant in variants:
        options = {k: v for k, v in variant.items() if k != "backend"}
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tensor_cores,
                backend=variant.get("backend", "fa2"),
                paged_kv_indptr_buffer=case.indptr.clone(),
                paged_kv_indices_buffer=case.indices.clone(),
                paged_kv_last_page_len_buffer=case.last.clone(),
            )
            wrapper.plan(
                case.indptr_cpu,
                case.indices,
                case.last_cpu,
                shape["heads"],
                shape["kv_heads"],
                HEAD_DIM,
                PAGE,
                q_data_type=BF16,
                kv_data_type=BF16,
                **options,
            )
            wrapper.run(q, case.caches[0], out=out)
            if reference is None:
                reference = out.clone()
            row[f"{name}_err"] = round(float((out.float() - reference.float()).abs().max()), 4)
            run = functools.partial(_run_attention, wrapper, q, case.caches, out)
            row[name] = round(graph_us(run, layers), 2)
        except Exception as exc:  # one variant's failure must not hide the others
            row[name] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
    timed = {n: v for n, v in row.items() if n.split("-")[0] in {"tc", "cc"} and isinstance(v, float)}
    if timed:
        best = min(timed, key=timed.__getitem__)
        row["best"] = best
        row["best_pct_bw"] = round(100 * case.kv_bytes() / bandwidth / (timed[best] * 1e-6), 1)
    return [row]


def kv_store_rows(shape: dict[str, Any], bs: int, layers: int) -> list[dict[str, Any]]:
    import flashinfer

    case = PagedCase(shape["kv_heads"], bs, 512, layers)
    k = torch.randn(bs, shape["kv_heads"], HEAD_DIM, dtype=BF16, device="cuda")
    v = torch.randn_like(k)
    pos = case.ctx - 1
    first_pages = case.indices[case.indptr[:-1].long() + pos // PAGE].long()
    loc = first_pages * PAGE + pos % PAGE
    batch_idx = torch.arange(bs, dtype=torch.int32, device="cuda")
    positions = torch.full((bs,), pos, dtype=torch.int32, device="cuda")
    flat = [(kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])) for kc, vc in case.caches]

    def index_put(i: int) -> None:
        flat[i][0][loc] = k
        flat[i][1][loc] = v

    def append(i: int) -> None:
        flashinfer.append_paged_kv_cache(
            k, v, batch_idx, positions, case.caches[i], case.indices, case.indptr, case.last
        )

    row: dict[str, Any] = {"part": "kv_store", "model": shape["name"], "bs": bs}
    row["index_put_x2"] = round(graph_us(index_put, layers), 2)
    try:
        append(0)
        same = torch.equal(case.caches[0][1].view(-1, *k.shape[1:])[loc], v)
        row["fi_append"] = round(graph_us(append, layers), 2)
        row["fi_append_matches"] = same
    except Exception as exc:
        row["fi_append"] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
    return [row]


def _context(spec: str, bs: int) -> tuple[int, list[int] | None]:
    """A decode_fused case's context: "512" (every row), or "100-2000" (each row's length uniform in that
    range, seeded: the uneven rows of an offline run) -> (longest row, per-row lengths or None)."""
    if "-" not in spec:
        return int(spec), None
    lo, hi = (int(v) for v in spec.split("-"))
    g = torch.Generator().manual_seed(bs)
    lens = torch.randint(lo, hi + 1, (bs,), generator=g).tolist()
    return max(lens), lens


def _act_rows(model: str, inter: int, batches: list[int]) -> list[dict[str, Any]]:
    from tandem.benchmarks.kernels.act_variants import act_rows  # defines a Triton kernel: CUDA hosts only

    return act_rows(model, inter, batches)


def sampling_rows(vocab: int, batches: list[int]) -> list[dict[str, Any]]:
    import flashinfer
    from torch.profiler import ProfilerActivity, profile

    from tandem.engine.layers.fused import FusedKernels

    def kernel_us(fn: Callable[[], object], iters: int = 20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        total = sum(e.self_device_time_total for e in prof.key_averages() if not e.key.startswith("Memcpy"))
        return round(float(total) / iters, 2)

    rows = []
    sampler = Sampler(vocab, device=torch.device("cuda"))
    for bs in batches:
        logits = torch.randn(bs, vocab, dtype=torch.float32, device="cuda") * 3
        batch = sampling(bs, torch.device("cuda"))
        temperature = batch.temperature
        scaled = functools.partial(torch.div, logits, temperature[:, None])
        fused = functools.partial(_compose, flashinfer.sampling.sampling_from_logits, scaled)
        # The engine's real input: the LM head's bf16 logits. Its sampler before the one-pass race
        # (float32 copy, division, flashinfer's draw) against with it.
        half = logits.to(torch.bfloat16)
        kernels = FusedKernels(8)
        before = Sampler(vocab, device=torch.device("cuda"), fused_draw=kernels.sample)
        race = Sampler(
            vocab, device=torch.device("cuda"), fused_draw=kernels.sample, race=kernels.race_sample
        )
        rows.append(
            {
                "part": "sampling",
                "vocab": vocab,
                "bs": bs,
                "torch_path": kernel_us(functools.partial(sampler, logits, batch)),
                "fi_from_logits": kernel_us(fused),
                "flashinfer_path_bf16": kernel_us(functools.partial(before, half, batch)),
                "race_path_bf16": kernel_us(functools.partial(race, half, batch)),
                "race_path_float32": kernel_us(functools.partial(race, logits, batch)),
                # The race kernel alone per slice count (its programs are batch x slices).
                "race_slices_bf16": race_sweep(kernel_us, kernels.race_sample, half, batch),
                "race_slices_float32": race_sweep(kernel_us, kernels.race_sample, logits, batch),
                **race_masked(kernel_us, kernels.race_sample, half, batch),
            }
        )
    return rows


def race_masked(
    kernel_us: Callable[[Callable[[], object]], float], race: Any, logits: torch.Tensor, batch: Any
) -> dict[str, float]:
    """The race kernel with every other row under a structured-output mask (random bits), which a mixed
    batch's plain rows share, and over those rows alone."""
    (rows, vocab), device = logits.shape, logits.device
    odd = torch.arange(1, rows, 2, device=device)
    bits = torch.randint(-(2**31), 2**31 - 1, (len(odd), -(-vocab // 32)), dtype=torch.int32, device=device)
    mask = {"bitmask": bits, "bitmask_vocab": vocab}
    per_row = (batch.temperature, batch.seeds, batch.steps, race_keys(vocab, device))
    alone = [t[odd] for t in (logits, *per_row[:3])] + [per_row[3]]
    masked = functools.partial(race, logits, *per_row, bitmask_rows=odd, **mask)
    only = functools.partial(race, *alone, bitmask_rows=torch.arange(len(odd), device=device), **mask)
    return (
        {"race_masked_bf16": kernel_us(masked), "race_odd_rows_only_bf16": kernel_us(only)}
        if len(odd)
        else {}
    )


def race_sweep(
    kernel_us: Callable[[Callable[[], object]], float], race: Any, logits: torch.Tensor, batch: Any
) -> dict[int, float]:
    keys = race_keys(logits.shape[1], logits.device)
    args = (logits, batch.temperature, batch.seeds, batch.steps, keys)
    return {s: kernel_us(functools.partial(race, *args, slices=s)) for s in (1, 2, 4, 8, 16, 32, 64)}


def _run_attention(wrapper: Any, q: torch.Tensor, caches: list[Any], out: torch.Tensor, i: int) -> None:
    wrapper.run(q, caches[i], out=out)


def _compose(outer: Callable[[Any], Any], inner: Callable[[], Any]) -> Any:
    return outer(inner())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument(
        "--parts", default="attention,decode_fused,norm,act,kv_store,gemm,chain,sampling,qk_norm_rope"
    )
    parser.add_argument("--gemm-libs", default=",".join(GEMM_LIBS), help="GEMM part: libraries to time")
    parser.add_argument("--gemm-batches", default="1,8,64", help="GEMM part: Llama-3.1-8B batch sizes")
    parser.add_argument(
        "--attention-cases", default="", help="model:batch:context:layers,... (default: the built-in cases)"
    )
    parser.add_argument("--attention-variants", default="", help="names in ATTENTION_VARIANTS (default: all)")
    parser.add_argument(
        "--fused-cases",
        default="",
        help="decode_fused part: model:batch:context,... (context: N, or LO-HI per row; default: built-in)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    gemm_libs = tuple(args.gemm_libs.split(","))
    parts = set(args.parts.split(","))
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    bandwidth = ceilings["copy_bandwidth_GBps"] * 1e9
    rows: list[dict[str, Any]] = []

    def section(name: str, make: Callable[..., list[dict[str, Any]]], *make_args: Any) -> None:
        if name not in parts:
            return
        try:
            new = make(*make_args)
        except Exception as exc:  # keep the other sections' figures
            new = [{"part": name, "failed": f"{type(exc).__name__}: {str(exc)[:200]}"}]
        rows.extend(new)
        for row in new:
            print(row, flush=True)
        release_memory()

    attention_cases = [
        (LLAMA, 1, 512, 32),
        (LLAMA, 8, 512, 32),
        (LLAMA, 64, 512, 8),
        (QWEN, 64, 1024, 8),
        (QWEN, 256, 1024, 4),
    ]
    if args.quick:
        attention_cases = attention_cases[::2]
    if args.attention_cases:
        shapes = {s["name"]: s for s in (LLAMA, QWEN)}
        attention_cases = [
            (shapes[m], int(b), int(c), int(n))
            for m, b, c, n in (case.split(":") for case in args.attention_cases.split(","))
        ]
    only = set(args.attention_variants.split(",")) if args.attention_variants else None
    for shape, bs, ctx, layers in attention_cases:
        section("attention", attention_rows, shape, bs, ctx, layers, bandwidth, only)
    fused_cases = [(LLAMA, b, "512") for b in (1, 2, 4, 8, 16, 32, 64)] + [(LLAMA, 1, "4096")]
    fused_cases += [(QWEN, b, "1024") for b in (8, 32, 64)] + [(QWEN, 256, "100-2000")]
    if args.fused_cases:
        by_name = {s["name"]: s for s in (LLAMA, QWEN)}
        fused_cases = [
            (by_name[m], int(b), c) for m, b, c in (case.split(":") for case in args.fused_cases.split(","))
        ]
    for shape, bs, ctx in fused_cases[::3] if args.quick else fused_cases:
        longest, lens = _context(ctx, bs)
        section("decode_fused", decode_fused_rows, shape, bs, longest, 32, lens)
    section("norm", norm_rows, LLAMA["name"], LLAMA["hidden"], [1, 8, 32, 64, 256])
    section("norm", norm_rows, QWEN["name"], QWEN["hidden"], [1, 64, 256])
    section("act", _act_rows, LLAMA["name"], LLAMA["inter"], [1, 8, 32])
    section("act", _act_rows, QWEN["name"], QWEN["inter"], [1, 32, 256])
    for shape, bs in [(LLAMA, 1), (LLAMA, 64), (QWEN, 256)]:
        section("kv_store", kv_store_rows, shape, bs, 32)
    gemm_batches = [int(b) for b in args.gemm_batches.split(",")] if not args.quick else [1]
    section("gemm", gemm_rows, LLAMA, gemm_batches, bandwidth, gemm_libs)
    if not args.quick:
        section("gemm", gemm_rows, QWEN, [64, 256], bandwidth, gemm_libs)
    for shape, bs in [(LLAMA, 1), (LLAMA, 4), (LLAMA, 8), (QWEN, 1), (QWEN, 8)]:
        section("chain", chain_rows, shape, bs)
    section("sampling", sampling_rows, 128256, [1, 64])
    section("sampling", sampling_rows, 151936, [256])
    section("qk_norm_rope", qk_norm_rope_rows, QWEN, [1, 64, 256], False)
    section("qk_norm_rope", qk_norm_rope_rows, GEMMA3_1B, [1, 8], True)
    path = write_result(
        "kernel-choices",
        {
            "config": {"page_size": PAGE, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
            "ceilings": ceilings,
            "results": rows,
        },
        device=device,
        out_dir=args.out_dir,
    )
    print(f"\n{path}")
    for part in (
        "attention",
        "decode_fused",
        "norm",
        "act",
        "kv_store",
        "gemm",
        "chain",
        "sampling",
        "qk_norm_rope",
    ):
        group = [r for r in rows if r.get("part") == part]
        if group:
            print_table(
                group,
                [
                    k
                    for k in group[0]
                    if k not in ("part", "triton_sweep") and not k.endswith(("_err", "_stored", "_replays"))
                ],
            )


if __name__ == "__main__":
    main()
