"""flashinfer's fused RMS-norm, rope, activation and sampling kernels, used on CUDA in place of torch ops.

Why: a float32 RMS norm written in torch is ~8 elementwise launches and a rotate-half rope ~20; a
Qwen3 layer has five norms and one rope, and its MLP's activation and product are two more. Inside a
decode CUDA graph each tiny launch still costs a few microseconds of GPU time, so at small and medium
batch those launches, not the GEMMs or the KV reads, set the step time. One kernel per norm (residual
add included), one per rope and one for the activation fix that.

Where a layer has per-head q/k norms, both norms and the rope are one Triton launch instead
(qk_norm_rope.py). The torch ops stay the reference (CPU, and `fused_kernels=False` on GPU). The fused
ones compute in float32 inside the kernel and round once, so they differ from the torch path by bf16
rounding only.
Never construct this on CPU: it imports flashinfer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.config import RopeConfig
from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.layers.low_rank import GemvDelta
from tandem.engine.layers.weight_scales import WeightScales
from tandem.engine.layers.yarn import yarn_attention_factor
from tandem.engine.sampler import RaceSample

logger = logging.getLogger(__name__)

# qk_norm_rope.qk_norm_rope: (qkv, positions, q_weight, k_weight, table, *, num_heads, num_kv_heads, eps,
# gemma) -> (q [T, H, D], k [T, Hkv, D]), both contiguous.
QKNormRope = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# triton_norm.add_rmsnorm: (x, residual or None, weight, eps, *, gemma) -> normed x.
SmallNorm = Callable[..., torch.Tensor]
# attention/triton_decode.decode_rope_attention: a small decode batch's qkv -> attention output [B, H * D].
DecodeRopeAttention = Callable[..., torch.Tensor]
# triton_act.silu_and_mul: (x [T, 2N], *, pdl) -> silu(gate) * up [T, N].
SmallAct = Callable[..., torch.Tensor]
# flashinfer's tinygemm2: (x, weight, out, bias or None, use_pdl) -> None, out = x weight^T (+ bias).
SmallGemm = Callable[..., None]
# triton_gemv.gemv: (x [T, K], weight [N, K], bias or None, *, pdl, delta, scales) -> x weight^T (+ bias)
# [T, N].
Gemv = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class TritonKernels:
    """tandem's Triton kernels, imported together: Triton is there for all of them or for none."""

    qk_norm_rope: QKNormRope
    race_sample: RaceSample
    decode_rope_attention: DecodeRopeAttention
    add_rmsnorm: SmallNorm
    silu_and_mul: SmallAct
    gemv: Gemv
    gemv_fits: Callable[..., bool]  # (weight, scales or None) -> bool
    gemv_takes_delta: Callable[[torch.Tensor, Sequence[int]], bool]

    @classmethod
    def load(cls) -> TritonKernels:
        from tandem.engine.attention.triton_decode import decode_rope_attention
        from tandem.engine.layers.qk_norm_rope import qk_norm_rope
        from tandem.engine.layers.triton_act import silu_and_mul
        from tandem.engine.layers.triton_gemv import fits, gemv, takes_delta
        from tandem.engine.layers.triton_norm import add_rmsnorm
        from tandem.engine.sampling_race import race_sample

        return cls(
            qk_norm_rope,
            race_sample,
            decode_rope_attention,
            add_rmsnorm,
            silu_and_mul,
            gemv,
            fits,
            takes_delta,
        )


class FusedKernels:
    """One per model: holds the cos/sin tables, shared by every layer with the same rope.

    `triton` and `tinygemm` say whether those kernels are there (EngineConfig resolved it once from the
    device's facts); which of them a forward runs is its `KernelPlan`'s to say.
    """

    def __init__(self, max_positions: int, *, triton: bool = True, tinygemm: bool = False) -> None:
        import flashinfer  # a CUDA-only dependency (extra `gpu`), imported on first construction

        self._norm: Any = flashinfer.norm
        self._rope: Any = flashinfer.rope
        self._activation: Any = flashinfer.activation
        self._sampling: Any = flashinfer.sampling
        self.triton: TritonKernels | None = TritonKernels.load() if triton else None
        # Both per-head q/k norms and the rope in one launch (qk_norm_rope.py), in place of `rmsnorm`
        # twice and `rope`, with the same float32 math and roundings.
        self.qk_norm_rope: QKNormRope | None = self.triton.qk_norm_rope if self.triton else None
        # The sampler's race in one pass over the logits (sampling_race.py).
        self.race_sample: RaceSample | None = self.triton.race_sample if self.triton else None
        # Small decode graphs: norms, rope, K/V store, attention and merge in one launch.
        self.decode_rope_attention: DecodeRopeAttention | None = (
            self.triton.decode_rope_attention if self.triton else None
        )
        self.max_positions = max_positions
        self._small_gemm: SmallGemm | None = tinygemm2() if tinygemm else None
        self._gemm_works: dict[tuple[int, int, int, bool], bool] = {}
        self.num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self._tables: dict[tuple[RopeConfig, int], torch.Tensor] = {}

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool, plan: KernelPlan = EAGER
    ) -> torch.Tensor:
        """x is [N, D] or [N, H, D] with a contiguous last dim (strided rows are fine: the q/k split).
        Per-head norms ([N, H, D]) take the eager plan: the Triton norm is for [N, D] rows."""
        if plan.triton_norms:
            assert self.triton is not None and x.dim() == 2
            return self.triton.add_rmsnorm(x, None, weight, eps, gemma=gemma, pdl=plan.pdl)
        # PDL is left off: it only shaves launch latency, and graph capture stays the plain kind.
        if not gemma:
            return self._norm.rmsnorm(x, weight, eps, enable_pdl=False)  # type: ignore[no-any-return]
        # flashinfer's Gemma norm takes 2D input only; per-head q/k norms (Gemma 3) go through a copy.
        flat = x.reshape(-1, x.shape[-1])
        return self._norm.gemma_rmsnorm(flat, weight, eps, enable_pdl=False).view(x.shape)  # type: ignore[no-any-return]

    def add_rmsnorm(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        gemma: bool,
        plan: KernelPlan = EAGER,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += delta, then delta = norm(residual), both in place: (normed, residual)."""
        if plan.triton_norms:
            assert self.triton is not None
            normed = self.triton.add_rmsnorm(delta, residual, weight, eps, gemma=gemma, pdl=plan.pdl)
            return normed, residual
        if gemma:
            self._norm.gemma_fused_add_rmsnorm(delta, residual, weight, eps, enable_pdl=False)
        else:
            self._norm.fused_add_rmsnorm(delta, residual, weight, eps, enable_pdl=False)
        return delta, residual

    def tinygemm_fits(self, weight: torch.Tensor) -> bool:
        """Whether a [N, K] weight is a shape tinygemm serves and wins on: bf16, N a multiple of 16 whose
        16-feature CTAs make at most two waves over the SMs, K a multiple of 64.

        tinygemm runs one 16-feature CTA per SM and streams the weight through TMA; with PDL it starts
        reading it while the kernel before it still runs, and it needs no split-K reduction. On an H200
        it beat cuBLAS up to two waves: Llama-3.1-8B's o and down (256 CTAs), and Qwen3-0.6B's o and
        down (64 CTAs, under one wave, where cuBLAS picks few-CTA or split-K kernels). It lost at three
        waves or more (q/k/v 384, gate/up 1,792: kernel-choices-chain*.json; see docs/tuning.md)."""
        n, k = weight.shape
        return (
            self._small_gemm is not None
            and weight.dtype == torch.bfloat16
            and n % 16 == 0
            and k % 64 == 0
            and n // 16 <= 2 * self.num_sms
            and weight.is_contiguous()
        )

    def gemv_fits(self, weight: torch.Tensor, scales: WeightScales | None = None) -> bool:
        """Whether a [N, K] weight is one the Triton GEMV (triton_gemv.py) takes: contiguous, K up to
        16,384 (Llama-3.1-8B's down projection, the widest measured, is 14,336), 16-bit or FP8 with its
        `scales`; others keep their library GEMM."""
        return self.triton is not None and self.triton.gemv_fits(weight, scales)

    def gemv_folds(self, x: torch.Tensor, weight: torch.Tensor, slice_offsets: Sequence[int]) -> bool:
        """Whether `gemv` of x by this weight runs the Triton GEMV and can add a low-rank delta whose
        slices start at these offsets."""
        return (
            self.triton is not None and _gemv_takes(x) and self.triton.gemv_takes_delta(weight, slice_offsets)
        )

    def gemv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: KernelPlan,
        delta: GemvDelta | None = None,
        scales: WeightScales | None = None,
    ) -> torch.Tensor:
        """x weight^T (+ bias) (+ a delta, where `gemv_folds`) as the Triton GEMV, for a weight that
        `gemv_fits` (an FP8 one with its `scales`), under a plan with `gemv`."""
        assert self.triton is not None
        if not _gemv_takes(x):
            assert delta is None
            real = weight if scales is None else scales.dequantize(weight).to(x.dtype)
            return torch.nn.functional.linear(x, real, bias)
        return self.triton.gemv(x, weight, bias, pdl=plan.pdl, delta=delta, scales=scales)

    def tinygemm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan
    ) -> torch.Tensor:
        """x weight^T (+ bias) as flashinfer's tinygemm, for a weight that `tinygemm_fits`, under a plan
        with `tinygemm`; F.linear for a shape whose probe failed."""
        rows = x.shape[0]
        if x.dim() != 2 or not x.is_contiguous() or x.dtype != torch.bfloat16:
            return torch.nn.functional.linear(x, weight, bias)
        key = (rows, weight.shape[0], weight.shape[1], bias is not None)
        works = self._gemm_works.get(key)
        if works is None and not torch.cuda.is_current_stream_capturing():
            works = self._gemm_works[key] = self._probe_gemm(x, weight, bias)
        if not works:  # unprobed during a capture (never in the engine: warm-up runs first) or failed
            return torch.nn.functional.linear(x, weight, bias)
        assert self._small_gemm is not None
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
        self._small_gemm(x, weight, out, bias, use_pdl=plan.pdl)
        return out

    def tinygemm_shapes(self) -> dict[tuple[int, int, int, bool], bool]:
        """(rows, out features, in features, bias) -> whether tinygemm serves it, for each shape probed."""
        return dict(self._gemm_works)

    def _probe_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """One eager tinygemm call of this shape (the graphs' warm-up makes it): False, with a warning,
        where it fails, e.g. a flashinfer install whose generated kernels for this shape lack sources."""
        assert self._small_gemm is not None
        try:
            self._small_gemm(
                x,
                weight,
                torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device),
                bias,
                use_pdl=False,
            )
        except Exception as exc:  # a build or launch failure: cuBLAS serves this shape instead
            logger.warning("tinygemm off for %s x %s: %r", tuple(x.shape), tuple(weight.shape), exc)
            return False
        return True

    def act_and_mul(self, x: torch.Tensor, *, gelu: bool, plan: KernelPlan = EAGER) -> torch.Tensor:
        """act(x[..., :d]) * x[..., d:] for the merged gate/up output, in one kernel (no [T, d] temporaries).

        The torch reference rounds act(gate) to bf16 before the product; this rounds once, in float32.
        """
        if not gelu and plan.triton_norms:
            assert self.triton is not None
            return self.triton.silu_and_mul(x, pdl=plan.pdl)
        act = self._activation.gelu_tanh_and_mul if gelu else self._activation.silu_and_mul
        return act(x, enable_pdl=False)  # type: ignore[no-any-return]

    def sample(self, scaled: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One draw per row from softmax(scaled) (float32 [B, V], -inf for filtered tokens), in one
        kernel that reads the logits once; its Philox offset advances `generator`."""
        tokens = self._sampling.sampling_from_logits(scaled, generator=generator)
        return tokens.to(torch.int64)  # type: ignore[no-any-return]

    def cos_sin_table(self, rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
        """float32 [max_positions, rotary_dim]: cos in the first half, sin in the second.

        Built with the same float32 products as the torch reference (position * inv_freq), so the
        angles agree bit for bit; only the rotation itself is rounded differently.
        """
        key = (rope, int(inv_freq.shape[0]) * 2)
        table = self._tables.get(key)
        if table is None:
            positions = torch.arange(self.max_positions, device=inv_freq.device, dtype=torch.int64)
            freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            if rope.rope_type == "yarn":  # YaRN scales cos and sin (layers/yarn.py)
                table = table * yarn_attention_factor(rope)
            table = table.contiguous()
            self._tables[key] = table
        return table

    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half (neox) rope on q [T, H, D] and k [T, Hkv, D] (rows may be strided).

        Out of place on purpose: the outputs are contiguous, which spares the attention kernel's
        input a copy when q is a strided view of the merged QKV projection.
        """
        q_out, k_out = self._rope.apply_rope_with_cos_sin_cache(
            positions, q, k, q.shape[-1], table, is_neox=True
        )
        return q_out.view(q.shape), k_out.view(k.shape)


def tinygemm2() -> SmallGemm | None:
    """flashinfer's reference tinygemm2 kernel, the one benchmarks/kernels/layer_chain.py times: called
    through its module rather than `flashinfer.gemm.tinygemm_bf16`, which on Hopper hands some shapes
    (Llama-3.1-8B's o and down among them) to generated per-shape programs instead. Built on first use."""
    try:
        from flashinfer.gemm.routergemm import get_tinygemm2_module
    except ImportError:
        return None

    def run(
        x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, use_pdl: bool
    ) -> None:
        module = get_tinygemm2_module()  # cached by flashinfer after the first call
        if bias is None:
            module.tinygemm2_nobias_op(x, weight, out, use_pdl)
        else:
            module.tinygemm2_op(x, weight, bias, out, use_pdl)

    return run


def _gemv_takes(x: torch.Tensor) -> bool:
    """The Triton GEMV's input: rows that may be strided, with a contiguous last dim."""
    return x.dim() == 2 and x.stride(1) == 1
