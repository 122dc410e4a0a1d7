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

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tandem.engine.config import RopeConfig
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


class FusedKernels:
    """One per model: holds the cos/sin tables, shared by every layer with the same rope."""

    def __init__(
        self, max_positions: int, small_rows: int = 0, pdl_rows: int = 0, gemm_rows: int = 0
    ) -> None:
        import flashinfer  # a CUDA-only dependency (extra `gpu`), imported on first construction

        self._norm: Any = flashinfer.norm
        self._rope: Any = flashinfer.rope
        self._activation: Any = flashinfer.activation
        self._sampling: Any = flashinfer.sampling
        # Both per-head q/k norms and the rope in one launch (qk_norm_rope.py), in place of `rmsnorm`
        # twice and `rope`, with the same float32 math and roundings; None where Triton is missing.
        self.qk_norm_rope: QKNormRope | None = _triton_qk_norm_rope()
        # The sampler's race in one pass over the logits (sampling_race.py); None where Triton is missing.
        self.race_sample: RaceSample | None = _triton_race_sample()
        # Small decode graphs: norms, rope, K/V store, attention and merge in one launch; None without Triton.
        self.decode_rope_attention: DecodeRopeAttention | None = _triton_decode_rope_attention()
        self.max_positions = max_positions
        # Norms over at most `small_rows` rows (small decode batches) run as one Triton program per row
        # (triton_norm.py) instead of flashinfer's kernel; None where Triton is missing.
        # Only while CUDA graphs are warmed up and captured (`graph_capture`): eagerly, Triton's host-side
        # launch costs more than the kernel saves (an eager batch-1 step took more than twice as long).
        self.small_rows = small_rows
        self._small_norm: SmallNorm | None = _triton_small_norm() if small_rows > 0 else None
        self._small_act: SmallAct | None = _triton_small_act() if small_rows > 0 else None
        # Graphs of at most `pdl_rows` rows launch the Triton kernels and tinygemm with programmatic
        # dependent launch (pdl.py); at most `gemm_rows` rows, their GEMMs run as flashinfer's tinygemm.
        self.pdl_rows = pdl_rows
        self.gemm_rows = gemm_rows
        self._small_gemm: SmallGemm | None = tinygemm2() if gemm_rows > 0 else None
        self._gemm_works: dict[tuple[int, int, int, bool], bool] = {}
        self._sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self._in_graphs = False
        self._tables: dict[tuple[RopeConfig, int], torch.Tensor] = {}

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool) -> torch.Tensor:
        """x is [N, D] or [N, H, D] with a contiguous last dim (strided rows are fine: the q/k split)."""
        if self._small(x):
            assert self._small_norm is not None
            return self._small_norm(x, None, weight, eps, gemma=gemma, pdl=self.uses_pdl(x))
        # PDL is left off: it only shaves launch latency, and graph capture stays the plain kind.
        if not gemma:
            return self._norm.rmsnorm(x, weight, eps, enable_pdl=False)  # type: ignore[no-any-return]
        # flashinfer's Gemma norm takes 2D input only; per-head q/k norms (Gemma 3) go through a copy.
        flat = x.reshape(-1, x.shape[-1])
        return self._norm.gemma_rmsnorm(flat, weight, eps, enable_pdl=False).view(x.shape)  # type: ignore[no-any-return]

    def add_rmsnorm(
        self, delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += delta, then delta = norm(residual), both in place: (normed, residual)."""
        if self._small(delta):
            assert self._small_norm is not None
            normed = self._small_norm(delta, residual, weight, eps, gemma=gemma, pdl=self.uses_pdl(delta))
            return normed, residual
        if gemma:
            self._norm.gemma_fused_add_rmsnorm(delta, residual, weight, eps, enable_pdl=False)
        else:
            self._norm.fused_add_rmsnorm(delta, residual, weight, eps, enable_pdl=False)
        return delta, residual

    def _small(self, x: torch.Tensor) -> bool:
        return (
            self._in_graphs
            and self._small_norm is not None
            and self._small_act is not None
            and x.dim() == 2
            and x.shape[0] <= self.small_rows
        )

    def uses_pdl(self, x: torch.Tensor) -> bool:
        """Whether a graph's kernel over x's rows launches with PDL (only the Triton kernels and tinygemm)."""
        return self._in_graphs and x.shape[0] <= self.pdl_rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear; in graphs of at most `gemm_rows` rows, flashinfer's tinygemm where it wins.

        tinygemm runs one 16-feature CTA per SM and streams the weight through TMA; with PDL it starts
        reading it while the kernel before it still runs, and it needs no split-K reduction. It beat
        cuBLAS where its CTAs make one to two full waves (Llama-3.1-8B's o and down, 256 CTAs), and
        lost where they make three or more (q/k/v 384, gate/up 1,792;
        benchmarks/results/kernel-choices-chain.json).
        Its shapes: bf16, out features a multiple of 16, in features of 64."""
        if not self._in_graphs or self._small_gemm is None:  # every eager GEMM: keep this path short
            return torch.nn.functional.linear(x, weight, bias)
        rows, n = x.shape[0] if x.dim() == 2 else -1, weight.shape[0]
        if (
            not 0 < rows <= self.gemm_rows
            or not self._sms <= n // 16 <= 2 * self._sms
            or x.dtype != torch.bfloat16
            or weight.dtype != torch.bfloat16
            or n % 16
            or weight.shape[1] % 64
            or not (x.is_contiguous() and weight.is_contiguous())
        ):
            return torch.nn.functional.linear(x, weight, bias)
        key = (rows, n, weight.shape[1], bias is not None)
        works = self._gemm_works.get(key)
        if works is None and not torch.cuda.is_current_stream_capturing():
            works = self._gemm_works[key] = self._probe_gemm(x, weight, bias)
        if not works:  # unprobed during a capture (never in the engine: warm-up runs first) or failed
            return torch.nn.functional.linear(x, weight, bias)
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        self._small_gemm(x, weight, out, bias, use_pdl=self.uses_pdl(x))
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

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Around the warm-up and capture of CUDA graphs: the kernels chosen for graphs only."""
        self._in_graphs = True
        try:
            yield
        finally:
            self._in_graphs = False

    def act_and_mul(self, x: torch.Tensor, *, gelu: bool) -> torch.Tensor:
        """act(x[..., :d]) * x[..., d:] for the merged gate/up output, in one kernel (no [T, d] temporaries).

        The torch reference rounds act(gate) to bf16 before the product; this rounds once, in float32.
        """
        if not gelu and self._small(x):
            assert self._small_act is not None
            return self._small_act(x, pdl=self.uses_pdl(x))
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
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
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


def _triton_qk_norm_rope() -> QKNormRope | None:
    """The fused q/k norm + rope, or None where Triton is missing (the three flashinfer kernels then)."""
    try:
        from tandem.engine.layers.qk_norm_rope import qk_norm_rope
    except ImportError:
        return None
    return qk_norm_rope


def _triton_decode_rope_attention() -> DecodeRopeAttention | None:
    try:
        from tandem.engine.attention.triton_decode import decode_rope_attention
    except ImportError:
        return None
    return decode_rope_attention


def _triton_small_norm() -> SmallNorm | None:
    try:
        from tandem.engine.layers.triton_norm import add_rmsnorm
    except ImportError:
        return None
    return add_rmsnorm


def _triton_small_act() -> SmallAct | None:
    try:
        from tandem.engine.layers.triton_act import silu_and_mul
    except ImportError:
        return None
    return silu_and_mul


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


def _triton_race_sample() -> RaceSample | None:
    try:
        from tandem.engine.sampling_race import race_sample
    except ImportError:
        return None
    return race_sample
