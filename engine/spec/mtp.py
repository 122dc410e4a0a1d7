"""DeepSeek-V3's multi-token-prediction layer as a draft head: checkpoint layer `num_hidden_layers` (the
first of `num_nextn_predict_layers`), which the target's own loading reads past.

It reads the target's final normed hidden state of a position (`hnorm`) beside the embedding of the next
token (`enorm`; the embedding is the target's, as the checkpoint's copy in the layer is the same),
projects the pair back to hidden size (`eh_proj`), runs one DeepSeek decoder block (latent attention and,
in V3, the MoE) and predicts through `shared_head.norm` and `shared_head.head`. For K > 1 the same layer
runs again on its own residual stream, as vLLM runs it.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from tandem.engine.config import FULL, ModelConfig
from tandem.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.engine.models.attention import Attention
from tandem.engine.models.common import DecoderLayer
from tandem.engine.models.context import Build, ForwardContext
from tandem.engine.models.latent_attention import LatentAttention
from tandem.engine.moe.spec import MoESpec
from tandem.engine.spec.head import DraftHead, HiddenCapture

# The layer's own tensors, named as the checkpoint names them under `model.layers.<n>.`; the rest of it
# is the decoder block's (`block.`).
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def mtp_layers(config: ModelConfig) -> int:
    """How many MTP layers the checkpoint appends (DeepSeek-V3's `num_nextn_predict_layers`)."""
    if config.architecture != "DeepseekV3ForCausalLM":
        return 0
    return int(config.raw.get("num_nextn_predict_layers") or 0)


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The target's config stretched over its MTP layers, so the block at index `num_layers` is built
    as the checkpoint's (full attention; the MoE where the dense/sparse rule puts it)."""
    total = config.num_layers + mtp_layers(config)
    moe = MoESpec.from_raw(config.raw, total) if config.moe is not None else None
    return replace(
        config,
        num_layers=total,
        layer_types=config.layer_types + (FULL,) * (total - config.num_layers),
        moe=moe,
    )


class SharedHead(nn.Module):
    def __init__(self, b: Build) -> None:
        super().__init__()
        c = b.config
        self.norm = b.norm(c.hidden_size)
        rows = VocabParallelEmbedding(c.vocab_size, c.hidden_size, b.tp, dtype=b.dtype, device=b.device)
        self.head = ParallelLMHead(rows, tied=True)  # the layer's own head, held by it alone


class MtpHead(DraftHead):
    capture = HiddenCapture(())  # the final normed hidden state

    def __init__(self, b: Build, embed: VocabParallelEmbedding, target_layers: int) -> None:
        super().__init__(b.config, embed)
        size = b.config.hidden_size
        self.index = target_layers
        self.enorm = b.norm(size)
        self.hnorm = b.norm(size)
        self.eh_proj = b.replicated(2 * size, size)
        self.block = DecoderLayer(b, target_layers)
        self.shared_head = SharedHead(b)
        self._prefix = re.compile(rf"model\.layers\.{target_layers}\.(.*)")

    @property
    def attention(self) -> Attention | LatentAttention:
        return self.block.self_attn

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan, block = ctx.plan, self.block
        # Position 0 has no token before it in training: its embedding is zero (as vLLM feeds it).
        embeds = self.embed(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds, plan), self.hnorm(hidden, plan)], dim=-1), plan)
        attn = block.self_attn(positions, block.input_layernorm(x, plan), ctx)
        residual, normed = block.finish(x, attn, self.shared_head.norm, plan)
        return residual, normed

    def propose(self, normed: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(normed).argmax(dim=-1)  # type: ignore[no-any-return]

    def checkpoint_name(self, name: str) -> str:
        """`model.layers.<n>.X` -> `X` for the layer's own tensors, `block.X` for its decoder block's
        (with DeepSeek's `shared_experts` -> `shared_expert`); other names stay as they are (ignored)."""
        found = self._prefix.fullmatch(name)
        if found is None:
            return name
        rest = re.sub(r"^mlp\.shared_experts\.", "mlp.shared_expert.", found.group(1))
        return rest if rest.startswith(_OWN) else f"block.{rest}"

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """The target's tensors, later MTP layers, and the layer's copy of the embedding."""
        return True
