"""The sampler: exact filtered distributions, seeded batch-invariant draws, penalties and logprobs."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine import sampler as sampler_module
from tandem.engine.batch import SamplingBatch
from tandem.engine.sampler import (
    Sampler,
    _log_exponential_,
    _mix32_,
    apply_penalties,
    log_exponential_noise,
)


def make_batch(n: int, **kw: Any) -> SamplingBatch:
    """A batch of n rows; scalars broadcast, tensors/lists are taken per row."""
    defaults: dict[str, tuple[Any, torch.dtype]] = {
        "temperature": (1.0, torch.float32),
        "top_p": (1.0, torch.float32),
        "top_k": (0, torch.int64),
        "min_p": (0.0, torch.float32),
        "seeds": (0, torch.int64),
        "steps": (0, torch.int64),
        "presence_penalty": (0.0, torch.float32),
        "frequency_penalty": (0.0, torch.float32),
        "repetition_penalty": (1.0, torch.float32),
    }
    fields: dict[str, Any] = {}
    for name, (default, dtype) in defaults.items():
        value = kw.pop(name, default)
        if isinstance(value, (int, float)):
            fields[name] = torch.full((n,), value, dtype=dtype)
        else:
            fields[name] = torch.as_tensor(value, dtype=dtype).reshape(n)
    return SamplingBatch(**fields, **kw)


def concat(batches: list[SamplingBatch]) -> SamplingBatch:
    """Stack single-row batches (no history) into one, in the given order."""
    names = ["temperature", "top_p", "top_k", "min_p", "seeds", "steps"]
    names += ["presence_penalty", "frequency_penalty", "repetition_penalty"]
    return SamplingBatch(**{n: torch.cat([getattr(b, n) for b in batches]) for n in names})


def reference_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The filtered, renormalised distribution, computed independently in float64 (HF order)."""
    scaled = logits.double().numpy() / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1:
        renorm = np.where(keep, probs, 0.0) / probs[keep].sum()
        mass_before = np.cumsum(renorm[order]) - renorm[order]
        keep[order[mass_before >= top_p]] = False
    keep &= probs >= min_p * probs.max()
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


LOGITS = torch.randn(20, generator=torch.Generator().manual_seed(0)) * 2.0


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (1.5, 5, 1.0, 0.0),
        (1.0, 0, 0.7, 0.0),
        (0.8, 8, 0.6, 0.0),  # top-p measured on the top-k-renormalised mass
        (1.0, 0, 1.0, 0.1),
        (1.2, 10, 0.9, 0.05),
    ],
)
def test_empirical_distribution_matches_filtered_reference(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    n = 100_000
    expected = reference_probs(LOGITS, temperature, top_k, top_p, min_p)
    assert 1 < (expected > 0).sum() < 20 or (top_k, top_p, min_p) == (0, 1.0, 0.0)
    sampler = Sampler(20)
    # Half the draws vary the seed, half vary the step of one seed: both must be good noise sources.
    # A third pass has no explicit seeds, so the sampler draws from its own generator instead.
    sources: list[tuple[Any, Any, bool]] = [
        (torch.arange(n) * 7919 + 3, 0, True),
        (424242, torch.arange(n), True),
        (0, 0, False),
    ]
    for seeds, steps, explicit in sources:
        batch = make_batch(
            n,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            steps=steps,
            any_explicit_seed=explicit,
        )
        tokens = sampler(LOGITS.expand(n, 20), batch).next_tokens
        freq = torch.bincount(tokens, minlength=20).double().numpy() / n
        assert (freq[expected == 0] == 0).all(), "a filtered-out token was drawn"
        # Per-token binomial 5-sigma band (+1/n for rounding): ~6e-7 false-alarm chance per check, so
        # under 1e-4 over the whole test; a mis-renormalised or mis-cut filter moves some token by far more.
        sigma = np.sqrt(expected * (1 - expected) / n)
        assert np.all(np.abs(freq - expected) <= 5 * sigma + 1 / n), (freq, expected)


def test_adjacent_seeds_and_steps_draw_independently() -> None:
    """The joint histogram of consecutive draws is the product of the marginals (uniform over 4 tokens)."""
    n = 64_000
    sampler = Sampler(4)
    for seeds, steps in [(torch.arange(n + 1), 5), (99, torch.arange(n + 1))]:
        tokens = sampler(torch.zeros(n + 1, 4), make_batch(n + 1, seeds=seeds, steps=steps)).next_tokens
        pairs = torch.bincount(tokens[:-1] * 4 + tokens[1:], minlength=16).double().numpy() / n
        sigma = math.sqrt((1 / 16) * (15 / 16) / n)
        assert np.all(np.abs(pairs - 1 / 16) <= 5 * sigma), pairs


def test_mix32_matches_lowbias32_reference() -> None:
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    rng = random.Random(1)
    values = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(1000)]
    got = _mix32_(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32(v) for v in values]


def test_extreme_hashes_give_finite_exponential_noise() -> None:
    bits = torch.tensor([0, 1, 255, 256, 2**31, 2**32 - 256, 2**32 - 1], dtype=torch.int64)
    log_e = _log_exponential_(bits.clone())
    assert torch.isfinite(log_e).all()
    assert (log_e[:-1] >= log_e[1:]).all(), "E = -log(u) falls as the hash (u) grows"
    # Over a uniform sweep of hashes E has mean 1, as Exp(1) must.
    sweep = torch.arange(0, 2**32, 2**12 + 1, dtype=torch.int64)
    assert _log_exponential_(sweep).exp().mean().item() == pytest.approx(1.0, abs=1e-3)


def test_noise_is_a_pure_function_of_seed_step_and_index() -> None:
    seeds = torch.tensor([5, -1, 2**63 - 1, -(2**63), 5 + 2**40])
    steps = torch.tensor([3, 3, 0, 0, 3])
    noise = log_exponential_noise(seeds, steps, 50)
    assert torch.isfinite(noise).all()
    assert torch.equal(noise[0], log_exponential_noise(seeds[:1], steps[:1], 50)[0])
    assert torch.equal(noise[[3, 0]], log_exponential_noise(seeds[[3, 0]], steps[[3, 0]], 50))
    # A wider vocabulary extends the row's noise; it does not reshuffle it.
    assert torch.equal(noise[:, :50], log_exponential_noise(seeds, steps, 80)[:, :50])
    # Seeds that differ only in their high 32 bits get different noise.
    assert not torch.equal(noise[0], noise[4])


def _draw_sequence(
    logits: torch.Tensor, row: SamplingBatch, companions: list[SamplingBatch], at: int
) -> list[int]:
    """Tokens of `row` over 25 steps, placed at position `at` among `companions`."""
    sampler = Sampler(logits.shape[-1])
    out = []
    for step in range(25):
        me = SamplingBatch(**{**row.__dict__, "steps": torch.tensor([step])})
        rows = [*companions[:at], me, *companions[at:]]
        batch = concat(rows)
        full = logits[torch.randint(0, logits.shape[0], (len(rows),))]
        full[at] = logits[0]
        out.append(int(sampler(full, batch).next_tokens[at]))
    return out


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.9},
        {"temperature": 1.3, "top_p": 0.8, "top_k": 40, "min_p": 0.02},
    ],
)
def test_seeded_row_draws_the_same_in_any_batch(params: dict[str, Any]) -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 500) * 2
    row = make_batch(1, seeds=123456789, **params)

    def companion(i: int) -> SamplingBatch:
        return make_batch(
            1, seeds=i, temperature=0.3 + 0.2 * i, top_p=0.5 + 0.05 * i, top_k=i * 3, min_p=0.01 * i
        )

    alone = _draw_sequence(logits, row, [], 0)
    assert len(set(alone)) > 3, "draws should vary with the step"
    # Companions that use filters force the masked sort path, which must be a no-op for unfiltered rows.
    assert _draw_sequence(logits, row, [companion(i) for i in range(6)], 0) == alone
    assert _draw_sequence(logits, row, [companion(i) for i in range(6)], 4) == alone
    assert _draw_sequence(logits, row, [companion(i) for i in range(3, 12)], 9) == alone
    other_seed = SamplingBatch(**{**row.__dict__, "seeds": torch.tensor([987654321])})
    assert _draw_sequence(logits, other_seed, [], 0) != alone


def test_masked_filter_path_equals_host_skipped_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the sampler cannot skip filters without a sync; forcing that path must change nothing."""
    n = 2000
    logits = torch.randn(n, 300, generator=torch.Generator().manual_seed(3)) * 3
    batch = make_batch(n, seeds=torch.arange(n), temperature=torch.rand(n, generator=torch.Generator()) + 0.2)
    skipped = Sampler(300)(logits, batch).next_tokens
    monkeypatch.setattr(sampler_module, "_maybe_any", lambda mask: True)
    assert torch.equal(Sampler(300)(logits, batch).next_tokens, skipped)


def test_different_seeds_draw_differently() -> None:
    n = 64
    logits = torch.zeros(2 * n, 1000)
    seeds = torch.tensor([11] * n + [12] * n)
    tokens = Sampler(1000)(
        logits, make_batch(2 * n, seeds=seeds, steps=torch.arange(n).repeat(2))
    ).next_tokens
    # Uniform over 1000 tokens: independent sequences agree at ~0.06 of 64 positions.
    assert int((tokens[:n] == tokens[n:]).sum()) <= 3
    assert len(set(tokens[:n].tolist())) > 55


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    expected = [1, 0, 2]
    for all_greedy in (True, False):
        batch = make_batch(3, temperature=0.0, seeds=[1, 2, 3], all_greedy=all_greedy)
        assert Sampler(4)(logits, batch).next_tokens.tolist() == expected
    # Greedy rows ignore seeds and filters, and sit happily next to sampled rows.
    mixed = make_batch(
        3, temperature=[0.0, 1.0, 0.0], top_k=[2, 0, 1], top_p=[0.5, 1.0, 1.0], seeds=[7, 8, 9]
    )
    tokens = Sampler(4)(logits, mixed).next_tokens.tolist()
    assert tokens[0] == 1 and tokens[2] == 2


def test_padded_vocabulary_columns_are_never_drawn() -> None:
    logits = torch.cat([torch.zeros(500, 10), torch.full((500, 6), 50.0)], dim=1)
    tokens = Sampler(10)(logits, make_batch(500, seeds=torch.arange(500))).next_tokens
    assert int(tokens.max()) < 10


def _penalty_batch(**kw: Any) -> SamplingBatch:
    # Row 0: prompt [0, 1], output [3, 3, 1], padding. Row 1: prompt [2], output [5], then padding.
    history = torch.tensor([[0, 1, 3, 3, 1, -1], [2, 5, -1, -1, -1, -1]])
    return make_batch(2, history=history, prompt_lens=torch.tensor([2, 1]), **kw)


LOGITS_6 = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])


def test_repetition_penalty_covers_prompt_and_output() -> None:
    out = apply_penalties(LOGITS_6, _penalty_batch(repetition_penalty=[2.0, 4.0]))
    assert out[0].tolist() == [1.0, -2.0, 0.5, 1.5, -2.0, 1.0]
    assert out[1].tolist() == [2.0, -1.0, 0.125, 3.0, -2.0, 0.25]


def test_presence_and_frequency_cover_output_only_and_ignore_padding() -> None:
    out = apply_penalties(
        LOGITS_6, _penalty_batch(presence_penalty=[0.5, 1.0], frequency_penalty=[0.25, 0.5])
    )
    # Row 0: token 3 seen twice in output, token 1 once; token 0 only in the prompt.
    assert out[0].tolist() == pytest.approx([2.0, -1.75, 0.5, 2.0, -2.0, 1.0])
    # Row 1: token 5 once in output; token 2 prompt only; -1 padding hits neither token 0 nor token 5.
    assert out[1].tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0, -2.0, -0.5])


def test_all_penalties_combine_and_steer_greedy() -> None:
    batch = _penalty_batch(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, temperature=0.0, all_greedy=True
    )
    out = apply_penalties(LOGITS_6, batch)
    assert out[0].tolist() == pytest.approx([1.0, -2.75, 0.5, 0.5, -2.0, 1.0])
    # Without penalties both rows would pick token 3.
    assert Sampler(6)(LOGITS_6, batch).next_tokens.tolist() == [0, 3]


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 6) * 2
    batch = make_batch(
        2,
        temperature=[0.7, 0.0],
        top_k=[2, 0],
        seeds=[4, 5],
        history=torch.tensor([[0, 1, 2], [3, 4, -1]]),
        prompt_lens=torch.tensor([1, 1]),
        repetition_penalty=1.5,
        presence_penalty=1.0,
        num_logprobs=3,
    )
    before = logits.clone()
    result = Sampler(6)(logits, batch)
    assert torch.equal(logits, before), "the caller's logits must not be modified"
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs is not None and result.top_ids is not None and result.top_logprobs is not None
    assert torch.allclose(result.logprobs, raw.gather(1, result.next_tokens[:, None]).squeeze(1))
    ordered = raw.sort(dim=-1, descending=True)
    assert torch.equal(result.top_ids, ordered.indices[:, :3])
    assert torch.allclose(result.top_logprobs, ordered.values[:, :3])
    assert (result.top_logprobs[:, :-1] >= result.top_logprobs[:, 1:]).all()

    only_chosen = Sampler(6)(logits, SamplingBatch(**{**batch.__dict__, "num_logprobs": 0}))
    assert only_chosen.logprobs is not None and only_chosen.top_ids is None
    none = Sampler(6)(logits, SamplingBatch(**{**batch.__dict__, "num_logprobs": -1}))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, width=32), min_size=2, max_size=40),
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.integers(-1, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(-(2**63), 2**63 - 1),
    step=st.integers(0, 2**31),
)
def test_draw_lies_in_filtered_support_and_ignores_companions(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int, step: int
) -> None:
    vocab = len(logits)
    row = torch.tensor([logits])
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    batch = make_batch(1, seeds=seed, steps=step, **params)
    token = int(Sampler(vocab)(row, batch).next_tokens[0])

    values = np.array(logits, dtype=np.float64)
    if temperature == 0.0:
        assert token == int(np.argmax(values))
    else:
        probs = np.exp((values - values.max()) / temperature)
        probs /= probs.sum()
        higher = values > values[token]
        if top_k > 0:
            assert higher.sum() < top_k
            in_k = np.array([(values > v).sum() < top_k for v in values])
        else:
            in_k = np.ones(vocab, dtype=bool)
        if top_p < 1:
            # Loose by 1e-4 so float32-vs-float64 rounding at the exact cut cannot fail the property.
            assert probs[higher & in_k].sum() / probs[in_k].sum() < top_p + 1e-4
        assert probs[token] >= min_p * probs.max() * (1 - 1e-4)

    companion = make_batch(1, seeds=seed ^ 1, steps=step + 1, temperature=0.5, top_k=3, top_p=0.5, min_p=0.2)
    flipped = torch.cat([torch.flip(row, dims=[1]), row])
    assert int(Sampler(vocab)(flipped, concat([companion, batch])).next_tokens[1]) == token


def test_fused_draw_serves_unseeded_batches_only() -> None:
    """A fused draw (flashinfer's kernel on CUDA) gets the scaled, filtered logits of unseeded batches;
    seeded batches keep the counter-based race, and greedy rows keep argmax unless none is greedy."""
    calls: list[torch.Tensor] = []

    def draw(scaled: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        calls.append(scaled.clone())
        return torch.full((scaled.shape[0],), 1, dtype=torch.int64)

    sampler = Sampler(5, fused_draw=draw)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]] * 3)
    unseeded = make_batch(
        3,
        temperature=[0.5, 0.0, 2.0],
        top_k=2,
        any_top_k_top_p=True,
        any_min_p=False,
        any_explicit_seed=False,
    )
    assert sampler(logits, unseeded).next_tokens.tolist() == [1, 4, 1]
    assert len(calls) == 1
    expected = torch.tensor(
        [[-math.inf] * 3 + [6.0, 8.0], [-math.inf] * 3 + [3.0, 4.0], [-math.inf] * 3 + [1.5, 2.0]]
    )
    torch.testing.assert_close(calls[0], expected)
    no_greedy = make_batch(2, temperature=0.5, any_explicit_seed=False, any_greedy=False)
    assert sampler(logits[:2], no_greedy).next_tokens.tolist() == [1, 1]
    seeded = make_batch(3, temperature=0.5, seeds=[1, 2, 3], any_explicit_seed=True)
    sampler(logits, seeded)
    assert len(calls) == 2, "seeded rows must not use the fused draw"
