"""Token sampling: penalties, temperature, top-k / top-p / min-p, and seeded draws that need no generator.

Every row's randomness is a pure function of (seed, step, vocab index), produced by a counter-based
hash. So a seeded request draws the same tokens whatever else shares its batch and wherever its row
sits, and every tensor-parallel rank, holding the same all-gathered logits, draws the same token with
no broadcast. The draw is the exponential race (Gumbel-max in log space): argmax(log p - log E) with
E ~ Exp(1) per token is an exact sample from p, and because it needs no normalisation the filtered
logits can be used as they are (-inf outside the support).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from tandem.engine.batch import SamplingBatch
from tandem.engine.constraints import constrain_logits

_MASK32 = 0xFFFFFFFF
# Temperatures below this are greedy, as in vLLM: dividing by them would overflow the logits.
GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SampleResult:
    next_tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B], logprob of the chosen token; None when num_logprobs < 0
    top_ids: torch.Tensor | None  # int64 [B, n] when num_logprobs > 0
    top_logprobs: torch.Tensor | None  # float32 [B, n], sorted descending


def _mix32_(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Wellons' lowbias32 hash, in place, on int64 tensors holding values in [0, 2^32).

    Every product must stay below 2^63 (signed int64 overflow is undefined in torch's kernels), so
    multipliers are kept under 2^31: the second constant 0x846CA68B is split as 0x046CA68B + 2^31,
    and x * 2^31 mod 2^32 is just the low bit of x moved to bit 31. Each step is a bijection on 32 bits.
    `scratch` (same shape) spares the [B, V] case one fresh allocation per step, which on CPU costs
    more in page faults than the arithmetic itself.
    """
    tmp = torch.empty_like(x) if scratch is None else scratch
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    high = torch.bitwise_and(x, 1, out=tmp).bitwise_left_shift_(31)
    x.mul_(0x046CA68B).add_(high).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    return x


def log_exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log E for E ~ Exp(1), float32 [B, V], a pure function of (seeds[b], steps[b], v).

    The row key hashes all 64 seed bits and the step; the vocab index is hashed on its own, so two rows
    never see shifted copies of one noise sequence. A final full hash round per element decorrelates rows.
    """
    seeds = seeds.to(torch.int64)
    key = _mix32_((steps.to(torch.int64) & _MASK32) ^ 0x9E3779B9)
    key = _mix32_(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32_(key ^ (seeds & _MASK32))
    bits = key[:, None] ^ vocab_keys(vocab_size, seeds.device)[None, :]
    return _log_exponential_(_mix32_(bits, torch.empty_like(bits)))


def vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The per-column half of the noise key: int64 [V] holding hashes in [0, 2^32), the same for every row."""
    return _mix32_(torch.arange(vocab_size, device=device, dtype=torch.int64) ^ 0x632BE5AB)


def race_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """`vocab_keys` as int32 bit patterns, the table sampling_race.py reads (wraps above 2^31, same bits)."""
    return vocab_keys(vocab_size, device).to(torch.int32)


def _log_exponential_(bits: torch.Tensor) -> torch.Tensor:
    """Uniform 32-bit hashes (consumed) to log E, E ~ Exp(1) by inversion: E = -log(u)."""
    # The top 24 bits, forced odd, give u = (2j + 1) / 2^24: exact in float32 and strictly inside (0, 1),
    # so -log(u) is finite and positive. Truncating the exponential's tails at ~6e-8 biases nothing visibly.
    u = bits.bitwise_right_shift_(8).bitwise_or_(1).to(torch.float32).mul_(2.0**-24)
    return u.log_().neg_().log_()


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt and output (HF / vLLM), presence and frequency over output only."""
    if batch.history is None:
        return logits
    history, prompt_lens = batch.history.to(torch.int64), batch.prompt_lens
    if prompt_lens is None:
        raise ValueError("SamplingBatch.history needs prompt_lens to tell prompt from output")
    rows, vocab = logits.shape
    valid = history >= 0
    # Padding (-1) scatters into an extra column that is dropped, which avoids any boolean indexing.
    ids = torch.where(valid, history, vocab)
    positions = torch.arange(history.shape[1], device=history.device)
    is_output = valid & (positions[None, :] >= prompt_lens[:, None])
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids, is_output.to(logits.dtype))
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, ids, True)
    counts, seen = counts[:, :vocab], seen[:, :vocab]

    rep = batch.repetition_penalty.to(logits.dtype)[:, None]
    # Penalty 1 divides or multiplies by one, which is exact, so unpenalised rows come out bit-identical.
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    frequency = batch.frequency_penalty.to(logits.dtype)[:, None]
    presence = batch.presence_penalty.to(logits.dtype)[:, None]
    penalised: torch.Tensor = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return penalised


def _maybe_any(mask: torch.Tensor) -> bool:
    """Whether any row may use a filter, without a device sync.

    Host tensors are read for free. On an accelerator, reading would stall the CPU until the forward
    finishes and break the scheduler's overlap, so we answer True and run the masked filter, which is an
    exact no-op for rows that have it off. (Host-side flags in SamplingBatch would let the GPU skip the sort.)
    """
    return mask.device.type != "cpu" or bool(mask.any())


def filter_logits_(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k, then top-p over the top-k renormalised mass, then min-p, in place: removed tokens become -inf.

    Cuts are value thresholds, so tokens tied with the last kept one are kept too (no scatter back
    from sorted order, and ties are treated alike whatever their index).
    """
    vocab = scaled.shape[-1]
    top_k, top_p = batch.top_k, batch.top_p.to(scaled.dtype)
    min_p = batch.min_p.to(scaled.dtype).clamp(max=1.0)  # above 1 the floor would exceed the top token
    use_k = batch.any_top_k_top_p and _maybe_any(top_k > 0)
    use_p = batch.any_top_k_top_p and _maybe_any(top_p < 1)
    if use_k or use_p:
        ordered = scaled.sort(dim=-1, descending=True).values
        keep = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
        if use_p:
            in_k = torch.arange(vocab, device=scaled.device)[None, :] < keep[:, None]
            cumulative = ordered.masked_fill(~in_k, -math.inf).softmax(dim=-1).cumsum(dim=-1)
            # The smallest prefix whose mass reaches top_p: every token whose inclusive cumsum is below
            # top_p, plus the one that crosses it. top_p >= 1 is off outright, so float rounding of the
            # total can never shave the tail.
            keep_p = (cumulative < top_p[:, None]).sum(dim=-1) + 1
            keep = torch.where(top_p < 1, torch.minimum(keep, keep_p), keep)
        threshold = ordered.gather(1, (keep - 1)[:, None])
        scaled.masked_fill_(scaled < threshold, -math.inf)
    if batch.any_min_p and _maybe_any(min_p > 0):
        # p >= min_p * p_max is logit >= max_logit + log(min_p); log(0) = -inf keeps everything.
        floor = scaled.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
        scaled.masked_fill_(scaled < floor, -math.inf)
    return scaled


def exponential_race(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax(scores - log E): an exact draw from softmax(scores), -inf entries never win."""
    return log_exponential_noise(seeds, steps, scores.shape[-1]).neg_().add_(scores).argmax(dim=-1)


# (scaled logits [B, V], generator) -> int64 [B]: one draw per row from softmax(scaled).
FusedDraw = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
# sampling_race.race_sample: (logits [B, V'], temperature, seeds, steps, race_keys, *, vocab_size)
# -> int64 [B], the exponential race (plain argmax for greedy rows) in one pass.
RaceSample = Callable[..., torch.Tensor]


class Sampler:
    """Stateless apart from the vocabulary size: wider logits (a padded lm_head) are cut to it.

    `fused_draw` (flashinfer's sampling kernel, on CUDA with fused kernels on) replaces the
    exponential race for batches where no row brought a seed: one pass over [B, V] instead of five.
    Seeded rows always take the counter-based race, which is what makes them reproducible.

    `race` (sampling_race.py, on CUDA with fused kernels on and Triton present) takes every batch
    without penalties, filters, biases or logprobs, seeded or not: the race in one pass over the logits
    as the LM head left them (structured-output rows masked inside the race), where the other paths
    first make a float32 copy, divide it and draw.

    `fuse=True` (for CUDA) compiles the race with torch.compile: the eager hash makes ~25 passes over
    [B, V] int64, which fused become one, bit-identical. Compiling takes seconds on first use (and again
    for B=1), so it is opt-in. Only the race is compiled: inductor
    (torch 2.11) fails to compile the filters' cumsum.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        fuse: bool = False,
        seed: int = 0,
        device: torch.device | None = None,
        fused_draw: FusedDraw | None = None,
        race: RaceSample | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self._fused_draw = fused_draw
        self._race_one_pass = race
        self._vocab_keys = None if race is None else race_keys(vocab_size, device or torch.device("cpu"))
        # The race's per-row tickets (zero between launches), grown to the largest batch seen.
        self._race_tickets: torch.Tensor | None = None
        self._race = torch.compile(exponential_race, dynamic=True) if fuse else exponential_race
        # For batches where no row brought a seed: one exponential_ kernel instead of the hash.
        self._generator = torch.Generator(device=device or "cpu")
        self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        if logits.shape[-1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, vocabulary has {self.vocab_size}")
        if self._one_pass(batch):
            return SampleResult(self._one_pass_race(logits, batch), None, None, None)
        raw = logits[:, : self.vocab_size].float()
        penalised = constrain_logits(apply_penalties(raw, batch), batch)
        if batch.all_greedy:
            # torch.argmax returns the first maximal index: ties go to the lowest id, deterministically.
            tokens = penalised.argmax(dim=-1)
        else:
            tokens = self._draw(penalised, batch)
        return _with_logprobs(raw, tokens, batch.num_logprobs)

    def warm_up(self, logits_dtype: torch.dtype) -> str | None:
        """Compile the one-pass race for every batch-size class it has (one per power-of-two slice
        count), plain and with structured-output rows masked, for logits of `logits_dtype` as the model
        hands them over (Triton builds a kernel per input dtype: warmed for another, the first requests
        would pay for fourteen builds), so no request waits on a build, and check its tokens against the
        torch path on a small batch. On any failure the race is switched off, and the reason returned for
        the log. The constraints' bitmask kernel is built first, whatever the race."""
        self._warm_up_constraints()
        if self._race_one_pass is None or self._vocab_keys is None:
            return None
        device = self._vocab_keys.device
        g = torch.Generator(device=device).manual_seed(0)
        # Values a bf16 LM head could give, whatever dtype they travel in.
        logits = (torch.randn(3, self.vocab_size, generator=g, device=device) * 3).to(torch.bfloat16)
        logits = logits.to(logits_dtype)
        temperature = torch.tensor([0.7, 0.0, 1.3], device=device)
        seeds = torch.tensor([11, 2**40 + 7, -5], device=device)
        steps = torch.tensor([0, 3, 1000], device=device)
        plain = SamplingBatch.greedy(3, device)
        plain = replace(
            plain,
            temperature=temperature,
            seeds=seeds,
            steps=steps,
            all_greedy=False,
            any_greedy=True,
            any_explicit_seed=True,  # the torch path's seeded race: the draw the one pass must match
        )
        # Rows 0 and 1 constrained: row 0 to every other token of the tokenizer's first half (a head
        # padded past the tokenizer), row 1 to one token.
        half = self.vocab_size // 2
        allowed = torch.zeros(2, self.vocab_size, dtype=torch.bool, device=device)
        allowed[0, :half:2] = True
        allowed[1, half - 1] = True
        masked = replace(
            plain,
            bitmask=_pack_bits(allowed),
            bitmask_rows=torch.tensor([0, 1], device=device),
            bitmask_vocab=half,
        )
        try:
            for batch in (plain, masked):
                want = self(logits, replace(batch, num_logprobs=0)).next_tokens  # the torch path
                for slices in (1, 2, 4, 8, 16, 32, 64):
                    got = self._one_pass_race(logits, batch, slices=slices)
                    if not torch.equal(got, want):
                        raise RuntimeError(f"tokens {got.tolist()} against the torch path's {want.tolist()}")
        except Exception as exc:  # a build or launch failure as much as a wrong token
            self._race_one_pass = None
            return f"one-pass sampling race off: {exc!r}"
        return None

    def _warm_up_constraints(self) -> None:
        """Build the bitmask kernel (xgrammar's Triton kernel on CUDA) now, not on the first
        structured-output request."""
        device = self._generator.device
        batch = SamplingBatch.greedy(1, device)
        bitmask = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
        rows = torch.zeros(1, dtype=torch.int64, device=device)
        masked = replace(batch, bitmask=bitmask, bitmask_rows=rows)
        constrain_logits(torch.zeros(1, self.vocab_size, device=device), masked)

    def _one_pass_race(self, logits: torch.Tensor, batch: SamplingBatch, **launch: int) -> torch.Tensor:
        """The one-pass race's tokens; structured-output rows are masked inside it (no copy, gather or
        scatter of the logits)."""
        assert self._race_one_pass is not None
        rows = (batch.temperature, batch.seeds, batch.steps)
        mask = {
            "bitmask": batch.bitmask,
            "bitmask_rows": batch.bitmask_rows,
            "bitmask_vocab": batch.bitmask_vocab,
        }
        tickets = self._race_tickets
        if tickets is None or tickets.shape[0] < logits.shape[0]:
            tickets = self._race_tickets = torch.zeros(
                logits.shape[0], dtype=torch.int32, device=logits.device
            )
        return self._race_one_pass(
            logits, *rows, self._vocab_keys, vocab_size=self.vocab_size, tickets=tickets, **mask, **launch
        )

    def _one_pass(self, batch: SamplingBatch) -> bool:
        """Whether the one-pass race can take the batch: nothing but temperatures and seeds to honour."""
        return (
            self._race_one_pass is not None
            and not batch.all_greedy
            and batch.history is None
            and not batch.any_top_k_top_p
            and not batch.any_min_p
            and batch.num_logprobs < 0
            and batch.bias_rows is None  # biases add in float32; a bitmask it applies in place
        )

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        temperature = batch.temperature.to(logits.dtype)
        greedy = temperature < GREEDY_EPS
        scaled = filter_logits_(logits / torch.where(greedy, 1.0, temperature)[:, None], batch)
        if batch.any_explicit_seed:
            sampled = self._race(scaled, batch.seeds, batch.steps)
        elif self._fused_draw is not None:
            sampled = self._fused_draw(scaled, self._generator)
        else:
            noise = torch.empty_like(scaled).exponential_(generator=self._generator)
            sampled = (scaled - noise.log_()).argmax(dim=-1)
        if not batch.any_greedy:
            return sampled
        # Penalties apply to greedy rows too; filters never remove the top token, so plain argmax is right.
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [G, V] -> int32 [G, ceil(V / 32)] in xgrammar's packing: bit v % 32 of word v // 32."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed.to(torch.int64)
    words = (padded.view(rows, -1, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: int) -> SampleResult:
    """Logprobs of the logits as the model produced them, before penalties and filters (vLLM's "raw")."""
    if num_logprobs < 0:
        return SampleResult(tokens, None, None, None)
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if num_logprobs == 0:
        return SampleResult(tokens, chosen, None, None)
    top = logprobs.topk(min(num_logprobs, raw.shape[-1]), dim=-1, sorted=True)
    return SampleResult(tokens, chosen, top.indices, top.values)
