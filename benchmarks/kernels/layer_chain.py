"""kernel_choices.py's `chain` part: one whole decode layer of a small batch (norm, q/k/v, the one-launch
attention, o, norm, gate/up, activation, down) as a chain of kernels in a CUDA graph, with the kernel
choices that only pay together:
- the Triton activation (engine/layers/triton_act.py) in place of flashinfer's;
- flashinfer's reference tinygemm2 kernel (a small-M GEMM that streams its weights through TMA; the one
  FusedKernels calls) in place of cuBLAS, for some or all four GEMMs;
- tandem's Triton GEMV (engine/layers/triton_gemv.py) for all four GEMMs;
- programmatic dependent launch (engine/layers/pdl.py): each kernel lets the next start at once, and
  tinygemm and the GEMV load their weights before they wait for their input, so the weight stream of a
  GEMM overlaps the small kernel before it.

Alone, each kernel's time hides how much of it the next one could overlap; here the figure is µs per
layer over `layers` distinct weight and K/V sets cycled `repeat` times, so L2 serves none of them. Each
variant also records its largest difference from the first variant's layer output (one eager layer from
the same state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.benchmarks.common import graph_us
from tandem.benchmarks.kernels.paged_case import BF16, HEAD_DIM, PAGE, PagedCase


@dataclass(frozen=True)
class Variant:
    name: str
    triton_act: bool
    tiny: frozenset[str]  # the GEMMs run by tinygemm: qkv, o, gate_up, down
    pdl: bool
    gemv: frozenset[str] = frozenset()  # the GEMMs run by the Triton GEMV (engine/layers/triton_gemv.py)


ALL = frozenset({"qkv", "o", "gate_up", "down"})
OD = frozenset({"o", "down"})
FIT = frozenset({"qkv", "o", "down"})  # where tinygemm's CTAs make at most two waves on Qwen3-0.6B
VARIANTS = [
    Variant("engine", False, frozenset(), False),  # what the engine ran before this part
    Variant("triton-act", True, frozenset(), False),
    Variant("pdl", True, frozenset(), True),
    Variant("tiny-od", True, OD, False),
    Variant("pdl-tiny-od", True, OD, True),
    Variant("pdl-tiny-all", True, ALL, True),
    Variant("pdl-tiny-fit", True, FIT, True),  # the engine's choice up to 8 rows on Qwen3-0.6B
    Variant("pdl-gemv-all", True, frozenset(), True, ALL),  # the engine's choice at one row
]


def chain_rows(
    shape: dict[str, Any], bs: int, ctx: int = 512, layers: int = 8, repeat: int = 4
) -> list[dict[str, Any]]:
    chain = _Chain(shape, bs, ctx, layers)
    row: dict[str, Any] = {"part": "chain", "model": shape["name"], "bs": bs, "ctx": ctx}
    reference: torch.Tensor | None = None
    for variant in VARIANTS:
        try:
            out = chain.check(variant)
            if reference is None:
                reference = out
            row[f"{variant.name}_err"] = round(float((out.float() - reference.float()).abs().max()), 4)
            row[variant.name] = round(graph_us(lambda i, v=variant: chain.layer(i, v), layers * repeat), 2)
        except Exception as exc:  # one variant's failure must not hide the others
            row[variant.name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
    return [row]


class _Chain:
    """The weights, K/V caches and state of `layers` Llama-style decode layers (no q/k norms)."""

    def __init__(self, shape: dict[str, Any], bs: int, ctx: int, layers: int) -> None:
        from tandem.engine.attention.triton_decode import DecodeScratch, launch_config

        h, i, heads, kvh = shape["hidden"], shape["inter"], shape["heads"], shape["kv_heads"]
        self.heads, self.kvh, self.layers = heads, kvh, layers
        g = torch.Generator(device="cuda").manual_seed(bs)

        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, dtype=BF16, device="cuda", generator=g) * k**-0.5

        self.weights = [
            (w((heads + 2 * kvh) * HEAD_DIM, h), w(h, heads * HEAD_DIM), w(2 * i, h), w(h, i))
            for _ in range(layers)
        ]
        self.norm_w = torch.randn(2, h, dtype=BF16, device="cuda", generator=g) * 0.1 + 1
        case = PagedCase(kvh, bs, ctx, layers)
        self.flat = [(k.view(-1, kvh, HEAD_DIM), v.view(-1, kvh, HEAD_DIM)) for k, v in case.caches]
        self.pages = (case.indptr, case.indices)
        per_row = -(-ctx // PAGE)
        last_page = case.indices[case.indptr[:-1].long() + per_row - 1].long()
        self.slots = (last_page * PAGE + (ctx - 1) % PAGE).to(torch.int32)
        self.old = torch.full((bs,), ctx - 1, dtype=torch.int32, device="cuda")
        self.positions = torch.full((bs,), ctx - 1, dtype=torch.int64, device="cuda")
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
        freqs = torch.arange(ctx, device="cuda").float()[:, None] * inv[None, :]
        self.table = torch.cat((freqs.cos(), freqs.sin()), -1).contiguous()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.splits, self.block_n = launch_config(bs, kvh, sms)
        self.scratch = DecodeScratch.allocate(
            max_bs=bs,
            max_row_splits=bs * self.splits,
            num_heads=heads,
            num_kv_heads=kvh,
            head_dim=HEAD_DIM,
            device="cuda",
        )
        self.start = tuple(torch.randn(bs, h, dtype=BF16, device="cuda", generator=g) for _ in range(2))
        self.residual = self.start[0].clone()
        self.delta = self.start[1].clone()

    def check(self, variant: Variant) -> torch.Tensor:
        """One eager layer from the fixed starting state: its output, to compare the variants by."""
        self.residual.copy_(self.start[0])
        self.delta = self.start[1].clone()
        self.layer(0, variant)
        torch.cuda.synchronize()
        return self.delta.clone()

    def layer(self, j: int, v: Variant) -> None:
        import flashinfer

        from tandem.engine.attention.triton_decode import decode_rope_attention
        from tandem.engine.layers.fused import tinygemm2
        from tandem.engine.layers.triton_act import silu_and_mul
        from tandem.engine.layers.triton_gemv import gemv as triton_gemv
        from tandem.engine.layers.triton_norm import add_rmsnorm

        qkv_w, o_w, gu_w, d_w = self.weights[j % self.layers]
        tiny = tinygemm2()

        def gemm(name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if name in v.gemv:
                return triton_gemv(x, weight, pdl=v.pdl)
            if name not in v.tiny:
                return F.linear(x, weight)
            out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
            assert tiny is not None
            tiny(x, weight, out, None, v.pdl)
            return out

        x = add_rmsnorm(self.delta, self.residual, self.norm_w[0], 1e-5, gemma=False, pdl=v.pdl)
        attn = decode_rope_attention(
            gemm("qkv", x, qkv_w),
            self.positions,
            None,
            None,
            self.table,
            self.flat[j % self.layers],
            self.pages,
            self.old,
            self.slots,
            self.scratch,
            num_heads=self.heads,
            num_kv_heads=self.kvh,
            eps=0.0,
            gemma=False,
            scale=HEAD_DIM**-0.5,
            page_size=PAGE,
            splits=self.splits,
            block_n=self.block_n,
            pdl=v.pdl,
        )
        x = add_rmsnorm(gemm("o", attn, o_w), self.residual, self.norm_w[1], 1e-5, gemma=False, pdl=v.pdl)
        merged = gemm("gate_up", x, gu_w)
        if v.triton_act:
            act = silu_and_mul(merged, pdl=v.pdl)
        else:
            act = flashinfer.activation.silu_and_mul(merged, enable_pdl=False)
        self.delta = gemm("down", act, d_w)
