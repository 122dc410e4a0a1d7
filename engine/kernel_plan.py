"""Which kernels one forward shape runs, decided once per captured shape rather than per call.

A `KernelPlan` is resolved for each decode graph's batch size and each piecewise graph's token bucket
when the graphs are captured, and one (`EAGER`) serves every batch that runs outside a graph. The model's
layers read the plan from the forward context (or the piecewise runner's argument): no layer asks
"am I in a graph" or compares row counts on its own.

Why the limits are what they are (H200, see docs/tuning.md): inside graphs of up to 32 rows the Triton
norms, activation and one-launch decode beat flashinfer's kernels; up to 8 rows PDL and tinygemm win; at
one row the Triton GEMV, whose weight load overlaps the kernel before it, wins over both GEMM kernels.
Eagerly, Triton's host-side launch costs more than the kernel saves, so `EAGER` keeps all of them off.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.engine_config import EngineConfig


@dataclass(frozen=True)
class KernelPlan:
    rows: int = 0  # the graph's rows (decode batch or piecewise tokens); 0 for eager batches
    # Each full-attention layer runs q/k norms, rope, K/V store, attention and merge as one Triton launch
    # (attention/triton_decode.py) where its KV group is served (no window, no soft-cap).
    fused_decode: bool = False
    triton_norms: bool = False  # residual add + RMS norm and SiLU-and-multiply as Triton kernels
    pdl: bool = False  # Triton kernels and tinygemm launch with programmatic dependent launch
    tinygemm: bool = False  # GEMMs of the shapes tinygemm wins (`Linear.tinygemm_fits`) run as tinygemm
    gemv: bool = False  # GEMMs run as the Triton GEMV (layers/triton_gemv.py), ahead of tinygemm
    # Some rows run with a LoRA adapter: the linear layers add their deltas (engine/lora/). Graphs are
    # captured with and without it, so a batch of base rows alone runs none of the LoRA kernels.
    lora: bool = False
    # The LoRA kernels launch with PDL in every graph where PDL is available (they are a chain of two,
    # each safe after any kernel: one that does not release its dependents early is simply waited for).
    lora_pdl: bool = False


EAGER = KernelPlan()
EAGER_LORA = KernelPlan(lora=True)


@dataclass(frozen=True)
class KernelPlanner:
    """The row limits of one engine, resolved from its config (the device's facts are already in it)."""

    fused_decode_rows: int = 0
    triton_norm_rows: int = 0
    pdl_rows: int = 0
    tinygemm_rows: int = 0
    gemv_rows: int = 0
    lora_pdl: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> KernelPlanner:
        return cls(
            # The one launch reads and writes 16-bit caches only: never over an FP8 pool.
            fused_decode_rows=0 if config.kv_cache_dtype is not None else config.fused_decode_max_bs,
            triton_norm_rows=config.fused_decode_max_bs,
            pdl_rows=config.pdl_max_bs,
            tinygemm_rows=config.small_gemm_max_bs,
            gemv_rows=config.gemv_max_bs,
            lora_pdl=config.pdl_max_bs > 0,
        )

    def decode(self, batch_size: int) -> KernelPlan:
        """The plan of the decode graph of `batch_size` rows."""
        return self._graph(batch_size, fused_decode=batch_size <= self.fused_decode_rows)

    def piecewise(self, tokens: int) -> KernelPlan:
        """The plan of the piecewise graphs of a `tokens` bucket (attention runs outside them)."""
        return self._graph(tokens, fused_decode=False)

    def _graph(self, rows: int, *, fused_decode: bool) -> KernelPlan:
        return KernelPlan(
            rows=rows,
            fused_decode=fused_decode,
            triton_norms=rows <= self.triton_norm_rows,
            pdl=rows <= self.pdl_rows,
            tinygemm=rows <= self.tinygemm_rows,
            gemv=rows <= self.gemv_rows,
            lora_pdl=self.lora_pdl,
        )
