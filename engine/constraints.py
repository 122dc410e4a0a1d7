"""Logit constraints applied before sampling: additive biases and structured-output token bitmasks.

Both act on the float32 logits after penalties and before temperature and the filters, as in vLLM, on
a copy, so the logprobs the API reports stay those of the model; a batch the one-pass sampler takes (no
logprobs, penalties, filters or biases) has its bitmask applied inside the race kernel instead
(sampling_race.py). The bitmask is
xgrammar's packed format (bit v % 32 of word v // 32), applied with xgrammar's kernel: its Triton kernel
on CUDA, its C++ loop on CPU. Only the constrained rows are gathered and masked.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from tandem.engine.batch import SamplingBatch


def constrain_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`logits` [B, V] float32 with the batch's biases added and disallowed tokens at -inf (a copy)."""
    if not batch.constrained:
        return logits
    out = logits.clone()
    if batch.bias_rows is not None:
        assert batch.bias_ids is not None and batch.bias_values is not None
        out.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values.to(out.dtype), accumulate=True)
    if batch.bitmask is not None:
        apply_bitmask_(out, batch)
    return out


def apply_bitmask_(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Disallowed tokens of the bitmask's rows at -inf, in place; the other rows are not touched."""
    assert batch.bitmask is not None and batch.bitmask_rows is not None
    rows = logits.index_select(0, batch.bitmask_rows)
    vocab = logits.shape[-1] if batch.bitmask_vocab is None else min(batch.bitmask_vocab, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(rows, batch.bitmask, vocab_size=vocab)
    if vocab < logits.shape[-1]:
        rows[:, vocab:] = float("-inf")  # ids with no text, which no grammar accepts
    logits.index_copy_(0, batch.bitmask_rows, rows)
