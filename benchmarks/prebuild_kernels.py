"""Build flashinfer's attention kernels for the variants tandem uses, in one parallel ninja run.

flashinfer compiles each kernel variant on first use, one after another (tens of seconds to minutes
each on an H200). tandem needs one module per (head_dim, sliding window, soft-cap) in bf16: the fa2
paged prefill module, which also serves tensor-core decode (see FlashInferBackend), plus the norm,
rope, activation and sampling modules of the fused kernels and the K/V append module. Building them
together uses every core at once; `save_fi_cache DIR` (from .device/gpu-env.sh) then keeps them for
the next host. Best effort: if this flashinfer's internals differ, the kernels still build lazily.

    python benchmarks/prebuild_kernels.py            # what tests/gpu and the benchmarks use
    python benchmarks/prebuild_kernels.py --softcap  # plus Gemma 2's soft-capped variants
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

# (head_dim, sliding window, soft-cap): Qwen3/Llama shapes; Gemma 3's global and local layers.
VARIANTS = [(128, False, False), (256, False, False), (256, True, False)]
SOFTCAP_VARIANTS = [(128, False, True), (128, True, True)]  # Gemma 2 shapes in tests/gpu


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--softcap", action="store_true", help="also build the soft-capped variants")
    args = parser.parse_args()
    variants = VARIANTS + (SOFTCAP_VARIANTS if args.softcap else [])
    try:
        from flashinfer.jit import build_jit_specs
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
        start = time.perf_counter()
        build_jit_specs(specs)
    except Exception as exc:  # the kernels will still build on first use
        print(f"prebuild skipped: {exc!r}", file=sys.stderr)
        return 0
    took = time.perf_counter() - start
    print(f"built {len(specs)} flashinfer modules (attention {variants}, norm, rope, ...) in {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
