"""Which rows carry drafts, and what a verified row changes: one rank's speculative decoding state.

A row with drafts emits between 1 and k + 1 tokens, and the host learns how many only when the batch is
processed. The schedule needs each request's length to place its next row, so a request whose drafted
row is in flight gets no row in the next batch (its `kv_len` runs ahead of `device_len` until then, which
the schedule already skips). Drafts are looked up from tokens the host has: in the overlap loop a
request whose last step is still in flight is skipped once, so its next step has them all; a lookup that
finds nothing leaves the request plain for a few steps (`MISS_BACKOFF`), never waiting on the host.
Requests with a grammar never draft (their masks follow their tokens one at a time), nor do requests
that turned speculation off (`SamplingParams.speculative=False`, the `speculative: false` body field).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tandem.engine.batch import ForwardBatch, ForwardOutput
from tandem.scheduler.request import Request
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.scheduler.spec.draft_model import DraftEngine, gather_drafts, run_draft_steps
from tandem.scheduler.spec.hidden_drafts import HiddenDrafts, StoredBatch
from tandem.scheduler.spec.ngram import propose_ngram
from tandem.scheduler.spec.staging import DraftedRow, SpecPrepared

# Plain steps a request takes after a lookup found no draft, before it pauses for the next lookup.
MISS_BACKOFF = 4


class SpecDecoding:
    """Drafts per request at schedule time; lengths and acceptance counts when a batch is processed."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_seq_len: int,
        draft: DraftEngine | None = None,
        vocab_size: int = 0,
        hidden: HiddenDrafts | None = None,
    ) -> None:
        """`draft`: the draft model's engine (`draft_model`), whose KV pool shares the target's page ids;
        `vocab_size`: the tokenizer's, the ids a draft may propose; `hidden`: a hidden-state drafter
        (`eagle3`, `mtp`; spec/hidden_drafts.py)."""
        self.config = config
        self.max_seq_len = max_seq_len
        self.draft = draft
        self.hidden = hidden
        self.vocab_size = vocab_size
        self.num_drafts = 0  # rows verified with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def drafts(self, req: Request) -> tuple[int, ...] | None:
        """The drafts of `req`'s next decode row: empty for a plain row, None to skip it this step."""
        if req.grammar is not None or not req.sampling.speculative:
            return ()
        total = min(req.prompt_len + req.sampling.max_tokens, self.max_seq_len)
        # Every emitted token (k drafts and the bonus) must fit before the request's end.
        k = min(self.config.num_speculative_tokens, total - req.device_len - 1)
        if self.draft_lag is not None:
            # The drafter reads its inputs from the token pool on the device: no host token needed.
            return (-1,) * max(k, 0)
        known = req.device_len == req.prompt_len + len(req.output_ids)
        if not known:
            if req.draft_backoff > 0:
                req.draft_backoff -= 1
                return ()
            return None  # one step out, so the next lookup sees every token
        if k <= 0:
            return ()
        tokens = np.fromiter((*req.prompt_ids, *req.output_ids), dtype=np.int64, count=req.device_len)
        found = propose_ngram(tokens, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        if not found:
            req.draft_backoff = MISS_BACKOFF
        return tuple(found)

    def prepare(self, spec: SpecPrepared, pool: torch.Tensor) -> SpecPrepared:
        """On the engine stream, before the batch's inputs are gathered: put its drafts in the token
        pool (staged n-gram drafts, or the draft model's K steps) and return the drafts to verify."""
        if spec.draft_steps is None:
            pool.index_copy_(0, spec.draft_index, spec.draft_ids)
            return spec
        if self.hidden is not None:
            self.hidden.run_steps(spec.draft_steps, pool)
        else:
            assert self.draft is not None
            run_draft_steps(self.draft, spec.draft_steps, pool, self.vocab_size)
        return gather_drafts(spec, pool)

    @property
    def draft_lag(self) -> int | None:
        """Positions a device drafter's steps run behind the tokens they read; None: host drafts."""
        if self.hidden is not None:
            return 1
        return 0 if self.draft is not None else None

    def stored(self, batch: StoredBatch, output: ForwardOutput, pool: torch.Tensor) -> None:
        """A batch's tokens are in the pool: a hidden-state drafter runs over it."""
        if self.hidden is not None:
            self.hidden.follow(batch, output, pool)

    def follow(self, batch: ForwardBatch) -> None:
        """The draft model over the target's batch, so its KV holds every token the target's does
        (its logits are not used)."""
        if self.draft is not None:
            self.draft.step_logits(replace(batch, prompt_logprobs=None, lora_slots_cpu=None))

    def verified(
        self,
        rows: Sequence[DraftedRow],
        spec: SpecPrepared,
        output: ForwardOutput,
        dropped: Sequence[bool] = (),
    ) -> None:
        """Bring each drafted row's lengths to what it emitted (rejected drafts' KV is overwritten by the
        next row, which starts there), and count the acceptances. `dropped[i]`: row i's request had
        ended before the batch was processed (its tokens were thrown away): lengths only, no counts, as
        vLLM counts the drafts of running requests only."""
        assert output.accepted_host is not None, "a batch with drafts returns its accept counts"
        accepted: list[int] = output.accepted_host.tolist()
        for i, row in enumerate(rows):
            k = spec.drafts[i]
            if k == 0 or not row.samples:
                continue
            emitted = accepted[i]
            req = row.req
            req.device_len += emitted - 1
            req.kv_len = req.device_len - 1
            if dropped and dropped[i]:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += emitted - 1
            for j in range(emitted - 1):
                self.accepted_per_position[j] += 1

    def stats(self) -> dict[str, Any]:
        """vLLM's spec-decode counters, and the mean acceptance length (tokens per drafted row)."""
        drafts = self.num_drafts
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_mean_acceptance_length": 1.0 + self.num_accepted_tokens / drafts if drafts else 0.0,
        }
