"""What a model's modules are given besides weights and activations: `Build` at construction (the
config, the family's `Traits`, TP group, dtype, device, kernels) and `ForwardContext` on each forward
(attention backend, KV pool, kernel plan). Kept apart from the blocks so that every block module and
the engine take them from one place, without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.config import ModelConfig
from tandem.engine.distributed import TPGroup
from tandem.engine.kernel_plan import EAGER, KernelPlan
from tandem.engine.kv_pool import KVPool
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.layers.linear import ColumnParallelLinear, OutputShard, RowParallelLinear
from tandem.engine.layers.norm import GemmaRMSNorm, RMSNorm


@dataclass(frozen=True)
class Traits:
    """What sets one family apart from the Llama baseline."""

    gemma_norm: bool = False  # (1 + w) RMS norms
    sandwich_norms: bool = False  # extra norms after attention and around the MLP (Gemma 2/3)
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    o_proj_bias: bool = False  # the o projection has a bias too where `attention_bias` says so (gpt-oss)
    attention_sinks: bool = False  # a learned sink logit per head (`self_attn.sinks`; gpt-oss)


@dataclass(frozen=True)
class ForwardContext:
    """What a forward needs beyond activations: the planned attention backend, the KV pool, and the
    kernel plan of this shape (a decode graph's, or `EAGER`)."""

    attention: AttentionBackend
    pool: KVPool
    plan: KernelPlan = EAGER


class Build:
    """Construction arguments shared by every module of one model."""

    def __init__(
        self,
        config: ModelConfig,
        traits: Traits,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        kernels: FusedKernels | None = None,
        *,
        expert_parallel: bool = False,
        mxfp4_experts: bool = False,
        fp8_experts: tuple[int, int] | None = None,
    ) -> None:
        self.config, self.traits, self.tp, self.dtype, self.device = config, traits, tp, dtype, device
        self.kernels = kernels
        # MoE layers: whole experts per rank instead of a slice of every expert (moe/spec.py ExpertShard).
        self.expert_parallel = expert_parallel
        # MoE experts kept as MXFP4 bytes that the Triton kernels unpack (moe/experts.py), not dense.
        self.mxfp4_experts = mxfp4_experts
        # MoE experts kept as block-scaled FP8 (this block) that the Triton kernels scale, not dense.
        self.fp8_experts = fp8_experts

    def column(self, in_features: int, shards: list[OutputShard], *, bias: bool) -> ColumnParallelLinear:
        return ColumnParallelLinear(
            in_features, shards, bias=bias, dtype=self.dtype, device=self.device, kernels=self.kernels
        )

    def replicated(self, in_features: int, out_features: int, *, bias: bool = False) -> ColumnParallelLinear:
        """A linear layer every rank holds whole (an MoE router, a shared expert's gate): a column-parallel
        layer of one unsplit output, so it takes the same small-GEMM kernels."""
        return self.column(in_features, [OutputShard(out_features, 0, out_features)], bias=bias)

    def row(self, in_features: int, out_features: int, *, bias: bool = False) -> RowParallelLinear:
        """With `bias`, only rank 0 adds it (RowParallelLinear): once per token."""
        return RowParallelLinear(
            in_features,
            out_features,
            self.tp,
            bias=bias,
            dtype=self.dtype,
            device=self.device,
            kernels=self.kernels,
        )

    def norm(self, size: int) -> RMSNorm:
        cls = GemmaRMSNorm if self.traits.gemma_norm else RMSNorm
        return cls(size, self.config.rms_norm_eps, dtype=self.dtype, device=self.device, kernels=self.kernels)
