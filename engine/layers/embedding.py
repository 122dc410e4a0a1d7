"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the (padded) vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.distributed import TPGroup
from tandem.engine.layers.source import TensorSource, check_shape


def load_vocab_rows(
    weight: nn.Parameter, source: TensorSource, start: int, vocab_size: int, what: str
) -> None:
    """Copy this rank's rows of a [vocab, hidden] tensor; rows past the real vocab stay zero."""
    check_shape(source, (vocab_size, weight.shape[1]), what)
    rows = max(0, min(weight.shape[0], vocab_size - start))
    if rows:
        weight.data[:rows].copy_(source.read(0, start, rows))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + part) of the vocab live on this rank; the others contribute zeros."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TPGroup, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        padded = -(-vocab_size // tp.size) * tp.size
        self.start, self.part = tp.shard(padded)
        self.weight = nn.Parameter(torch.zeros(self.part, hidden_size, dtype=dtype, device=device), False)

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        load_vocab_rows(self.weight, source, self.start, self.vocab_size, "the vocab embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.part)
        out = F.embedding(local.clamp(0, self.part - 1), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocab slice, all-gathered into the full vocab; may share the embedding."""

    def __init__(self, embedding: VocabParallelEmbedding, *, tied: bool) -> None:
        super().__init__()
        self.tp = embedding.tp
        self.vocab_size = embedding.vocab_size
        self.hidden_size = embedding.hidden_size
        self.start, self.part = embedding.start, embedding.part
        if tied:
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(torch.zeros_like(embedding.weight), False)

    @property
    def padded_vocab(self) -> int:
        """The logits' width before the cut to `vocab_size`: every rank's slice, gathered."""
        return self.part * self.tp.size

    def load(self, source: TensorSource, shard_id: int, *, is_bias: bool) -> None:
        load_vocab_rows(self.weight, source, self.start, self.vocab_size, "the LM head")

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[..., vocab_size] logits; with `out` ([..., padded vocab], the weight's dtype) written there,
        with no buffer between (at TP 1 the GEMM itself writes `out`)."""
        if out is not None and self.tp.size == 1:
            logits = torch.matmul(hidden, self.weight.t(), out=out)
        else:
            logits = self.tp.all_gather_last_dim(F.linear(hidden, self.weight), out=out)
        return logits[..., : self.vocab_size]
