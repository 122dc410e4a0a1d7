"""One layer's attention block: the merged q/k/v projection, the per-head norms and the rope, then the
backend's attention. It alone picks between the routes a forward can take (plain; one Triton launch for
the norms, the rope and the K/V store; a small decode graph's one launch with attention too), so that
choice sits here, apart from the decoder stack in common.py, which only composes the blocks."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.attention.base import FusedDecode, LayerSpec
from tandem.engine.attention.sinks import AttentionSinks
from tandem.engine.kernel_plan import KernelPlan
from tandem.engine.kv_pool import KVPool
from tandem.engine.layers.linear import head_shard
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.models.context import Build, ForwardContext

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [T, H, D]; k and v [T, Hkv, D]


class Attention(nn.Module):
    def __init__(self, b: Build, layer_id: int, in_features: int | None = None) -> None:
        """`in_features`: the q/k/v projection's input width where it is not `hidden_size` (an EAGLE-3
        layer reads the token embedding and the hidden state side by side)."""
        super().__init__()
        c, tp = b.config, b.tp
        q_shard = head_shard(c.num_heads, c.head_dim, tp)
        kv_shard = head_shard(c.num_kv_heads, c.head_dim, tp)
        width = c.hidden_size if in_features is None else in_features
        self.qkv_proj = b.column(width, [q_shard, kv_shard, kv_shard], bias=c.attention_bias)
        self.o_proj = b.row(
            c.num_heads * c.head_dim, c.hidden_size, bias=b.traits.o_proj_bias and c.attention_bias
        )
        self.sinks = (
            AttentionSinks(
                c.num_heads,
                q_shard.start // c.head_dim,
                q_shard.size // c.head_dim,
                dtype=b.dtype,
                device=b.device,
            )
            if b.traits.attention_sinks
            else None
        )
        self.q_norm = b.norm(c.head_dim) if c.qk_norm else None
        self.k_norm = b.norm(c.head_dim) if c.qk_norm else None
        window = c.window_of(layer_id)
        self.rotary = RotaryEmbedding(
            c.rope if window is None else c.rope_local, c.head_dim, b.device, b.kernels
        )
        self.spec = LayerSpec(
            layer_id=layer_id,
            num_heads=q_shard.size // c.head_dim,
            num_kv_heads=kv_shard.size // c.head_dim,
            head_dim=c.head_dim,
            scale=c.attn_scale,
            window=window,
            softcap=c.attn_softcap,
            sinks=self.sinks is not None,
        )
        # On CUDA, the per-head norms (where the model has them) and the rope in one Triton launch
        # when the rope covers the whole head; that launch can also store K/V (`stores_kv`).
        table = self.rotary.table
        self.fused_qk = (
            b.kernels is not None
            and b.kernels.qk_norm_rope is not None
            and table is not None
            and table.shape[-1] == c.head_dim
            and c.head_dim & (c.head_dim - 1) == 0  # the kernel's blocks span half a head
        )
        self.kernels = b.kernels

    def stores_kv(self, ctx: ForwardContext | None) -> bool:
        """Whether `qkv` under `ctx` writes this step's K/V into the pool itself, so attention must not:
        with the fused launch, where the backend hands over the new tokens' slots."""
        return self._store(ctx) is not None

    def _store(self, ctx: ForwardContext | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k cache, v cache, slots) for the fused launch's K/V store under `ctx`, or None."""
        if ctx is None or not self.fused_qk:
            return None
        layer = self.spec.layer_id
        slots = ctx.attention.new_kv_slots(ctx.pool.layer_group[layer])
        return None if slots is None else (ctx.pool.k[layer], ctx.pool.v[layer], slots)

    def _fused(
        self,
        merged: torch.Tensor,
        positions: torch.Tensor,
        store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The one Triton launch: the q/k norms where the layer has them, the rope, and with `store`
        (k cache, v cache, slots) the K/V store."""
        assert self.kernels is not None and self.kernels.qk_norm_rope is not None
        assert self.rotary.table is not None
        s, q_norm, k_norm = self.spec, self.q_norm, self.k_norm
        return self.kernels.qk_norm_rope(
            merged,
            positions,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            self.rotary.table,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            eps=0.0 if q_norm is None else q_norm.eps,
            gemma=q_norm is not None and q_norm.gemma,
            kv_cache=store,
        )

    def warm_up_store(self, pool: KVPool) -> None:
        """Build the fused launch's store form for eager batches (their own int64 slots) now, at start:
        otherwise the first eager batch, a long prefill, would wait on a Triton build. It writes one
        token of zeros into the group's dummy page, which no request owns."""
        if not self.fused_qk or pool.fp8:  # an FP8 pool is written by the backend's store only
            return
        layer = self.spec.layer_id
        k_cache, v_cache = pool.k[layer], pool.v[layer]
        slot = pool.dummy_page(pool.layer_group[layer]) * pool.page_size
        merged = k_cache.new_zeros(1, sum(self.qkv_proj.output_sizes))
        slots = torch.full((1,), slot, dtype=torch.int64, device=k_cache.device)
        self._fused(merged, torch.zeros_like(slots), (k_cache, v_cache, slots))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the layer's normed input to the attention output [T, H * D], before the o projection."""
        group = ctx.pool.layer_group[self.spec.layer_id]
        # The plan picks the route: the one launch (where this layer's KV group is served), else the
        # q/k/v step (storing K/V itself where it can) and the backend's attention.
        # The one launch has no sinks: a layer with them never takes it (nor does the backend offer it).
        one_launch = ctx.plan.fused_decode and self.fused_qk and self.sinks is None
        fused = ctx.attention.fused_decode(group) if one_launch else None
        if fused is not None:
            return self._fused_decode(self.qkv_proj(x, ctx.plan), positions, ctx, fused)
        q, k, v = self.qkv(positions, x, ctx.plan, ctx)
        return ctx.attention.forward(
            self.spec, q, k, v, ctx.pool, stored=self.stores_kv(ctx), sinks=self.sink_logits
        )

    @property
    def sink_logits(self) -> torch.Tensor | None:
        """This rank's heads' sink logits [H], or None: what the backend's `forward` takes as `sinks`."""
        return None if self.sinks is None else self.sinks.weight

    def _fused_decode(
        self, merged: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, fused: FusedDecode
    ) -> torch.Tensor:
        """A small decode graph's one launch: norms, rope, K/V store, attention and merge."""
        assert self.kernels is not None and self.kernels.decode_rope_attention is not None
        assert self.rotary.table is not None
        s, q_norm, k_norm, layer = self.spec, self.q_norm, self.k_norm, self.spec.layer_id
        return self.kernels.decode_rope_attention(
            merged,
            positions,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            self.rotary.table,
            (ctx.pool.k[layer], ctx.pool.v[layer]),
            fused.pages,
            fused.old_lens,
            fused.slots,
            fused.scratch,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            eps=0.0 if q_norm is None else q_norm.eps,
            gemma=q_norm is not None and q_norm.gemma,
            scale=s.scale,
            page_size=fused.page_size,
            splits=fused.splits,
            block_n=fused.block_n,
            pdl=ctx.plan.pdl,
        )

    def project_out(self, attn_out: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        """The o projection (and its all-reduce): [T, H * D] -> [T, hidden]."""
        return self.o_proj(attn_out, plan)  # type: ignore[no-any-return]

    def qkv(
        self, positions: torch.Tensor, x: torch.Tensor, plan: KernelPlan, ctx: ForwardContext | None = None
    ) -> QKV:
        """Everything before the attention kernel: projection, per-head norms and rope; with `ctx`,
        also the K/V store where `stores_kv(ctx)` (k then comes back as the layer's K cache)."""
        s = self.spec
        merged = self.qkv_proj(x, plan)
        q, k, v = merged.split(self.qkv_proj.output_sizes, dim=-1)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.fused_qk:
            q, k = self._fused(merged, positions, self._store(ctx))
            return q, k, v
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v
