"""DeepSeek-V2/V3's multi-head latent attention (MLA): the attention block of those families, an
alternative to attention.py's q/k/v heads that the decoder layer picks from the config (`config.mla`).

Per token, one `kv_a_proj_with_mqa` gives the compressed latent `kv_c` (normed by `kv_a_layernorm`)
and one rope key `k_pe`, both shared by every head; the KV pool stores only them (kv_c, then k_pe: one
K "head" of `kv_lora_rank + qk_rope_head_dim`, and no V). Each head's no-rope key and its value are
`kv_b_proj` of the latent: rows W_UK [nope, kv_lora_rank] and W_UV [v_head_dim, kv_lora_rank] per head.

Attention runs in the absorbed form: the query's no-rope part is multiplied by W_UK into latent space,
so q . k = (q_nope W_UK) . kv_c + q_pe . k_pe, and the heads attend over the cached latent with V the
latent itself; the result, [H, kv_lora_rank] per token, is multiplied by W_UV before the o projection.
No per-head K or V is ever built or stored, which is what makes decode read one latent per token. The
torch backend uses the same form for prefill (one path); a GPU backend may expand the latent into
per-head K/V for long prefills instead, where the compute, not the cache reads, is the cost.

Tensor parallelism splits the heads (q, kv_b and o projections); the latent projection, its norm and
the cache are the same on every rank, whole.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.attention.base import LayerSpec
from tandem.engine.config import LatentAttentionSpec
from tandem.engine.kernel_plan import KernelPlan
from tandem.engine.kv_pool import KVPool
from tandem.engine.layers.linear import ColumnParallelLinear, head_shard
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.models.context import Build, ForwardContext

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [T, H, L + R]; k [T, 1, L + R]; v [T, 1, 0]


class LatentAttention(nn.Module):
    """HF's `self_attn` of a DeepSeek layer, named as the checkpoints name its tensors."""

    def __init__(self, b: Build, layer_id: int) -> None:
        super().__init__()
        c, tp = b.config, b.tp
        m = c.mla
        assert m is not None
        self.mla: LatentAttentionSpec = m
        q_shard = head_shard(c.num_heads, m.qk_head_dim, tp)
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if m.q_lora_rank is None:
            self.q_proj = b.column(c.hidden_size, [q_shard], bias=False)
        else:
            self.q_a_proj = b.replicated(c.hidden_size, m.q_lora_rank)
            self.q_a_layernorm = b.norm(m.q_lora_rank)
            self.q_b_proj = b.column(m.q_lora_rank, [q_shard], bias=False)
        self.kv_a_proj_with_mqa = b.replicated(c.hidden_size, m.latent_dim)
        self.kv_a_layernorm = b.norm(m.kv_lora_rank)
        self.kv_b_proj = b.column(
            m.kv_lora_rank, [head_shard(c.num_heads, m.qk_nope_head_dim + m.v_head_dim, tp)], bias=False
        )
        self.o_proj = b.row(c.num_heads * m.v_head_dim, c.hidden_size)
        self.rotary = RotaryEmbedding(
            c.rope, m.qk_rope_head_dim, b.device, b.kernels, interleaved=m.rope_interleave
        )
        self.num_heads = q_shard.size // m.qk_head_dim
        self.spec = LayerSpec(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=1,
            head_dim=m.latent_dim,
            scale=m.scale,
            window=None,
            softcap=None,
            latent_v=m.kv_lora_rank,
        )

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]) of this rank's heads: views of `kv_b_proj`'s weight."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def stores_kv(self, ctx: ForwardContext | None) -> bool:
        return False  # the backend stores the latent

    def warm_up_store(self, pool: KVPool) -> None:
        """Nothing to build: no fused rope + store launch for the latent."""

    @property
    def sink_logits(self) -> torch.Tensor | None:
        """None: latent attention has no sinks (the piecewise runner asks every layer)."""
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the layer's normed input to the heads' latent outputs [T, H * kv_lora_rank]; the
        value projection and the o projection follow in `project_out`."""
        q, k, v = self.qkv(positions, x, ctx.plan)
        return ctx.attention.forward(self.spec, q, k, v, ctx.pool)

    def qkv(
        self, positions: torch.Tensor, x: torch.Tensor, plan: KernelPlan, ctx: ForwardContext | None = None
    ) -> QKV:
        """The absorbed query [T, H, L + R] (q_nope W_UK, then the roped q_pe), the latent to store as
        the one K head [T, 1, L + R] (kv_c, then the roped k_pe), and an empty V [T, 1, 0]."""
        m = self.mla
        if self.q_proj is not None:
            q = self.q_proj(x, plan)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, plan), plan), plan)
        q = q.view(-1, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x, plan).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c, plan)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        w_uk, _ = self.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        query = torch.cat((q_latent, q_pe), dim=-1)
        latent = torch.cat((kv_c.unsqueeze(1), k_pe), dim=-1)
        return query, latent, latent[..., :0]

    def project_out(self, attn_out: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        """W_UV per head, then the o projection (and its all-reduce): [T, H * L] -> [T, hidden]."""
        _, w_uv = self.absorbed()
        latent = attn_out.view(-1, self.num_heads, self.mla.kv_lora_rank).transpose(0, 1)
        values = torch.bmm(latent, w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(values.reshape(values.shape[0], -1), plan)  # type: ignore[no-any-return]
