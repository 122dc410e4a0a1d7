"""The typed hand-off between the scheduler and the engine: plain tensors, never request objects.

The scheduler fills a `ForwardBatch`; the engine answers with a `ForwardOutput` that carries the event
marking the end of its device-to-host copy, so nobody blocks on the results by accident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.streams import Event


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters for one batch, as device tensors of length B.

    `seeds` and `steps` key a counter-based noise source: a row's draw depends only on its own seed and
    output position, never on what else is in the batch, and every TP rank draws the same token.
    """

    temperature: torch.Tensor  # float32; 0 means greedy
    top_p: torch.Tensor  # float32 in (0, 1]; 1 is off
    top_k: torch.Tensor  # int64; <= 0 is off
    min_p: torch.Tensor  # float32 in [0, 1]; 0 is off
    seeds: torch.Tensor  # int64; the scheduler derives one for unseeded requests
    steps: torch.Tensor  # int64; index of the output token being sampled (0 for the first)
    presence_penalty: torch.Tensor  # float32; 0 is off
    frequency_penalty: torch.Tensor  # float32; 0 is off
    repetition_penalty: torch.Tensor  # float32; 1 is off
    # Tokens seen so far per row (prompt, then output), right-padded with -1. None when no row
    # has a penalty, so the common case costs nothing.
    history: torch.Tensor | None = None  # int64 [B, L]
    prompt_lens: torch.Tensor | None = None  # int64 [B]; history[:, :prompt_lens] is the prompt
    all_greedy: bool = False
    # Whether any row is greedy (temperature 0): if none is, sampling skips the argmax it would
    # otherwise merge in for them.
    any_greedy: bool = True
    # Host-side hints, so the GPU can skip the sort-based filters without reading device tensors.
    any_top_k_top_p: bool = True
    any_min_p: bool = True
    # Whether any row brought its own seed. If none did, the sampler may draw from its own generator
    # (one fast kernel) instead of the per-row counter-based hash; every TP rank still draws the same
    # tokens, because every rank samples the same batches in the same order from the same seed.
    any_explicit_seed: bool = True
    # Top-n logprobs to return per row; -1 for none. 0 returns only the chosen token's logprob.
    num_logprobs: int = -1
    # Per-row constraints (constraints.py), None when no row has one, so plain batches pay nothing.
    # Additive biases as sparse (row, token, value) triples: logit_bias, and -inf on end tokens below
    # min_tokens.
    bias_rows: torch.Tensor | None = None  # int64 [K], device
    bias_ids: torch.Tensor | None = None  # int64 [K], device
    bias_values: torch.Tensor | None = None  # float32 [K], device
    # Structured outputs: bit v of bitmask[i] says whether token v is allowed in row bitmask_rows[i].
    bitmask: torch.Tensor | None = None  # int32 [G, ceil(V / 32)], device
    bitmask_rows: torch.Tensor | None = None  # int64 [G], device
    # The ids the bitmask speaks for (the tokenizer's); ids past them (a padded head) are never allowed.
    bitmask_vocab: int | None = None  # None: the whole head

    @property
    def constrained(self) -> bool:
        return self.bias_rows is not None or self.bitmask is not None

    @classmethod
    def greedy(cls, batch: int, device: torch.device | str = "cpu") -> SamplingBatch:
        """Argmax for every row, no penalties: for engine-level tests and benchmarks."""
        zeros = torch.zeros(batch, device=device)
        ints = torch.zeros(batch, dtype=torch.int64, device=device)
        ones = torch.ones(batch, device=device)
        return cls(
            temperature=zeros,
            top_p=ones,
            top_k=ints,
            min_p=zeros,
            seeds=ints,
            steps=ints,
            presence_penalty=zeros,
            frequency_penalty=zeros,
            repetition_penalty=ones,
            all_greedy=True,
            any_top_k_top_p=False,
            any_min_p=False,
            any_explicit_seed=False,
        )


@dataclass(frozen=True)
class AttentionGroupBatch:
    """Paging for one KV group (all full-attention layers, or all window layers of a hybrid model)."""

    # Logical page i of row b lives in physical page page_table[b, i] of this group's pool.
    page_table: torch.Tensor  # int32 [B, max_pages], device
    # Tokens [0, kv_start) were evicted by the sliding window; their table entries are stale.
    kv_start: torch.Tensor  # int32 [B], device; a multiple of page_size
    # Flat slot (page * page_size + offset) that receives each new token's K and V.
    out_cache_loc: torch.Tensor  # int64 [T], device
    kv_start_cpu: torch.Tensor  # int32 [B], host copy for planning
    page_table_cpu: torch.Tensor  # int32 [B, max_pages], host copy for planning


@dataclass(frozen=True)
class PromptLogprobBatch:
    """The prompt positions of a batch whose next-token log-probs were asked for (`prompt_logprobs`).

    Only these positions' hidden states go through the LM head, beside each row's last token; a batch
    where no row asks carries None and runs exactly as before.
    """

    token_index: torch.Tensor  # int64 [K], device: indices into the batch's T tokens
    target_ids: torch.Tensor  # int64 [K], device: the prompt token that follows each position
    num_top: int  # top alternatives to return per position (the most any row asked for); 0: none


@dataclass(frozen=True)
class SpecBatch:
    """Draft tokens to verify (speculative decoding). Row b with k drafts scores its last k + 1 tokens:
    position j checks draft j (the input token at j + 1) and the last one gives the bonus token. The
    sampling batch has one row per scored position ("sample rows", S = B + total drafts), so penalties,
    biases and seeds apply at each position as they would one step at a time."""

    logit_index: torch.Tensor  # int64 [S], device: the batch token whose logits each sample row scores
    draft_ids: torch.Tensor  # int64 [S], device: the draft each sample row checks; -1 for none (bonus)
    grid: torch.Tensor  # int64 [B, W], device: row b's sample rows in order, -1 past them; W = max k + 1


@dataclass(frozen=True)
class ForwardBatch:
    """One step: B rows, T new tokens in total, rows laid out back to back."""

    input_ids: torch.Tensor  # int64 [T], device
    positions: torch.Tensor  # int64 [T], device
    seq_lens: torch.Tensor  # int32 [B], device: KV length after this step
    extend_lens: torch.Tensor  # int32 [B], device: new tokens this step
    seq_lens_cpu: torch.Tensor  # int32 [B], host
    extend_lens_cpu: torch.Tensor  # int32 [B], host
    groups: tuple[AttentionGroupBatch, ...]  # indexed by KV group id
    sampling: SamplingBatch
    is_decode: bool  # every row extends by exactly one token
    # Each row's LoRA adapter slot, -1 for the base model (int32 [B], host); None when no row has one.
    lora_slots_cpu: torch.Tensor | None = None
    prompt_logprobs: PromptLogprobBatch | None = None
    spec: SpecBatch | None = None  # drafts to verify; None: one sample per row, as without speculation

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class ForwardOutput:
    """The sampled tokens on the device, and their host copies once `copy_done` has fired.

    With a SpecBatch every per-row tensor gains a position axis W: row b emitted its first
    `accepted[b]` tokens (accepted drafts, then the target's own token), the rest is to be ignored.
    """

    next_tokens: torch.Tensor  # int64 [B] ([B, W] with drafts), device: feeds the token pool on the device
    next_tokens_host: torch.Tensor  # int64 [B] ([B, W]), host (pinned on CUDA)
    logprobs_host: torch.Tensor | None  # float32 [B] ([B, W]): logprob of the chosen token
    top_ids_host: torch.Tensor | None  # int64 [B, n] ([B, W, n])
    top_logprobs_host: torch.Tensor | None  # float32 [B, n] ([B, W, n])
    copy_done: Event
    prompt: PromptLogprobs | None = None  # host copies, for a batch with a PromptLogprobBatch
    accepted: torch.Tensor | None = None  # int64 [B], device: tokens each row emitted; None: no drafts
    accepted_host: torch.Tensor | None = None  # int64 [B], host
    # Per token of the batch, the hidden states a hidden-state drafter reads (engine/spec/head.py).
    captured: torch.Tensor | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probs of prompt tokens under the model (float32 log-softmax of the raw logits)."""

    logprobs: torch.Tensor  # float32 [K]: of each target id
    top_ids: torch.Tensor | None  # int64 [K, n] when num_top > 0, best first
    top_logprobs: torch.Tensor | None  # float32 [K, n]


@dataclass(frozen=True)
class StepLogits:
    """What a forward produced: each row's last-token logits, and the prompt log-probs it was asked for."""

    logits: torch.Tensor  # [B, vocab], in the model's logits dtype
    prompt: PromptLogprobs | None = None
    captured: torch.Tensor | None = None  # per token: a drafter's hidden states (Engine.capture)
