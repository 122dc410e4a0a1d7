"""Build flashinfer's kernels for the variants tandem uses, all modules at once.

flashinfer compiles each kernel variant on first use, one after another (tens of seconds to minutes
each on an H200). tandem needs one module per (head_dim, sliding window, soft-cap) in bf16: the fa2
paged prefill module, which also serves tensor-core decode (see FlashInferBackend), plus the norm,
rope, activation and sampling modules of the fused kernels and the K/V append module.

Each module is built the way its first use builds it, by ninja in the module's own directory, with the
modules in parallel threads. Not through flashinfer's `build_jit_specs`: that runs one ninja over all
modules from their parent directory, so its build log lives there, and the first use, whose ninja
finds no log entry in the module's directory, compiles the module again (seen on an H200: a 40 s norm
rebuild after the prebuild, and a decode run that timed out in such rebuilds). Built this way, a second
run and every first use are no-ops, also on a host that restored the cache (pack_fi_cache.py).
Best effort: if this flashinfer's internals differ, the kernels still build lazily.

    python scripts/prebuild_kernels.py            # what tests/gpu and the benchmarks use
    python scripts/prebuild_kernels.py --softcap  # plus Gemma 2's soft-capped variants
    python scripts/prebuild_kernels.py --gpt-oss  # plus gpt-oss's head_dim-64 variants
    python scripts/prebuild_kernels.py --fp8      # plus the block-scaled FP8 GEMM (about 2 min alone)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

# (head_dim, sliding window, soft-cap): Qwen3/Llama shapes; Gemma 3's global and local layers.
VARIANTS = [(128, False, False), (256, False, False), (256, True, False)]
SOFTCAP_VARIANTS = [(128, False, True), (128, True, True)]  # Gemma 2 shapes in tests/gpu
GPT_OSS_VARIANTS = [(64, False, False), (64, True, False)]  # gpt-oss's full and 128-token window layers


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--softcap", action="store_true", help="also build the soft-capped variants")
    parser.add_argument("--gpt-oss", action="store_true", help="also build gpt-oss's head_dim-64 variants")
    parser.add_argument("--fp8", action="store_true", help="also build the FP8 GEMM of fp8_linear.py")
    args = parser.parse_args()
    variants = VARIANTS + (SOFTCAP_VARIANTS if args.softcap else [])
    variants += GPT_OSS_VARIANTS if args.gpt_oss else []
    try:
        from flashinfer.jit.activation import gen_act_and_mul_module
        from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module
        from flashinfer.jit.norm import gen_norm_module
        from flashinfer.jit.page import gen_page_module
        from flashinfer.jit.rope import gen_rope_module
        from flashinfer.jit.sampling import gen_sampling_module
        from flashinfer.utils import PosEncodingMode

        bf16 = torch.bfloat16
        specs = [
            _gen_batch_prefill_primary_module(
                "fa2", bf16, bf16, bf16, torch.int32, d, d, PosEncodingMode.NONE.value, window, softcap, False
            )
            for d, window, softcap in variants
        ]
        # The fused kernels (engine/layers/fused.py): norms, rope, and the MLP's act-and-mul.
        specs += [gen_norm_module(), gen_rope_module()]
        specs += [gen_act_and_mul_module(name) for name in ("silu", "gelu_tanh")]
        # The K/V append (flashinfer backend) and the fused sampler's draw.
        specs += [gen_page_module(), gen_sampling_module()]
        if args.fp8:
            specs += _fp8_specs()
        # Each module's ninja gets a share of twice the cores: the small modules finish early, and
        # nvcc jobs take GBs of memory each, so all modules at full width could exhaust it.
        share = -(-2 * (os.cpu_count() or 8) // len(specs))
        os.environ.setdefault("MAX_JOBS", str(max(2, share)))
        start = time.perf_counter()
        with ThreadPoolExecutor(len(specs)) as pool:
            seconds = list(pool.map(_build, specs))
    except Exception as exc:  # the kernels will still build on first use
        print(f"prebuild skipped: {exc!r}", file=sys.stderr)
        return 0
    took = time.perf_counter() - start
    fresh = sum(1 for s in seconds if s < 2.0)
    print(
        f"built {len(specs)} flashinfer modules (attention {variants}, norm, rope, ...) in {took:.0f} s; "
        f"{fresh} were already up to date"
    )
    return 0


def _fp8_specs() -> list[Any]:
    """The SM90 block-scaled FP8 GEMM's module, which FP8 layers build on first use otherwise; none
    where this flashinfer lacks it (its first use will say why)."""
    try:
        from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module
    except ImportError as exc:
        print(f"FP8 GEMM prebuild skipped: {exc!r}", file=sys.stderr)
        return []
    return [gen_fp8_blockscale_gemm_sm90_module()]


def _build(spec: Any) -> float:
    """One module by ninja in its own directory, as its first use would; seconds taken.

    A cache restored by pack_fi_cache.py holds empty object files. Should ninja want to redo any step
    of a module (a regenerated source, say), relinking the .so from those empty objects would give a
    library without its functions, so every empty object of that module is removed first and the
    whole module compiles again."""
    start = time.perf_counter()
    spec.write_ninja()
    dry = subprocess.run(
        ["ninja", "-n", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if "no work to do" not in dry.stdout:
        for obj in spec.build_dir.glob("*.o"):
            if obj.stat().st_size == 0:
                obj.unlink()
    spec.build(need_lock=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
