"""Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax as one more
key with no value. It takes probability mass and adds nothing, so a head may attend to "nothing".

The torch backend puts the sink into its softmax as transformers does. A kernel that returns each query
row's log-sum-exp over the keys (flashinfer) needs only an epilogue: with lse = log sum_j exp(s_j), the
softmax over the keys plus the sink is the keys' softmax times exp(lse) / (exp(lse) + exp(sink)), that is
out * sigmoid(lse - sink).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from tandem.engine.layers.source import TensorSource, check_shape

LN2 = math.log(2.0)


class AttentionSinks(nn.Module):
    """`self_attn.sinks`: the sink logits of this rank's query heads [start, start + count) of `total`."""

    def __init__(
        self, total: int, start: int, count: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.total, self.start = total, start
        self.weight = nn.Parameter(torch.empty(count, dtype=dtype, device=device), False)

    def checkpoint_entries(self, prefix: str, available: Collection[str]) -> dict[str, tuple[Any, int, bool]]:
        return {prefix: (self, 0, False)}

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        check_shape(source, (self.total,), "the attention sinks")
        self.weight.data.copy_(source.read(0, self.start, self.weight.shape[0]))


def sink_scale(lse: torch.Tensor, sinks: torch.Tensor, *, base2: bool) -> torch.Tensor:
    """float32 [T, H, 1]: sigmoid(lse - sink) for each query row and head; `lse` [T, H] over the keys,
    in log base 2 where `base2` (flashinfer's convention), else natural."""
    natural = lse.float() * LN2 if base2 else lse.float()
    return torch.sigmoid(natural - sinks.float()[None, :]).unsqueeze(-1)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *, base2: bool) -> torch.Tensor:
    """`out` [T, H, D] rescaled in place by `sink_scale` (in float32); returns it."""
    return out.copy_(out.float() * sink_scale(lse, sinks, base2=base2))


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The probabilities over the keys of scores [H, Q, L] (masked keys at -inf) with each head's sink
    as one more key, as transformers' eager gpt-oss attention computes them (max subtracted first)."""
    sink = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
