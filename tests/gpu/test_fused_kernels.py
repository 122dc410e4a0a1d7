"""The fused flashinfer norm, rope and activation kernels against the torch ops they replace on CUDA."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tandem.engine.config import RopeConfig
from tandem.engine.layers.fused import FusedKernels
from tandem.engine.layers.norm import GemmaRMSNorm, RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
BF16 = torch.bfloat16


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # One bf16 rounding apart at most (2^-8 relative), plus slack for values near zero.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2e-2)


@pytest.fixture(scope="module")
def kernels() -> FusedKernels:
    return FusedKernels(max_positions=8192)


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_norms_match_the_reference(kernels: FusedKernels, cls: type[RMSNorm]) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ref = cls(1024, 1e-6, dtype=BF16, device=DEVICE)
    fused = cls(1024, 1e-6, dtype=BF16, device=DEVICE, kernels=kernels)
    weight = torch.randn(1024, generator=g, device=DEVICE).to(BF16)
    ref.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    x = torch.randn(37, 1024, generator=g, device=DEVICE).to(BF16) * 3
    close(fused(x), ref(x))
    # The residual step: both outputs, with the fused kernel overwriting its inputs in place.
    delta = torch.randn(37, 1024, generator=g, device=DEVICE).to(BF16)
    want_h, want_x = ref.add(delta, x)
    residual, d = x.clone(), delta.clone()
    got_h, got_x = fused.add(d, residual)
    assert got_x.data_ptr() == residual.data_ptr() and got_h.data_ptr() == d.data_ptr()
    torch.testing.assert_close(got_x, want_x)  # the sum itself is one bf16 add on both paths
    close(got_h, want_h)


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_per_head_norm_on_a_strided_split(kernels: FusedKernels, cls: type[RMSNorm]) -> None:
    """Qwen3's and Gemma 3's q/k norms see views of the merged QKV output: rows strided."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    ref = cls(128, 1e-6, dtype=BF16, device=DEVICE)
    fused = cls(128, 1e-6, dtype=BF16, device=DEVICE, kernels=kernels)
    qkv = torch.randn(21, (16 + 8 + 8) * 128, generator=g, device=DEVICE).to(BF16)
    q = qkv[:, : 16 * 128].view(-1, 16, 128)
    assert not q.is_contiguous()
    close(fused(q), ref(q))


@pytest.mark.parametrize(
    "rope",
    [
        RopeConfig(theta=1e6),
        RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, original_max_position=8192),
        RopeConfig(theta=1e4, rope_type="linear", factor=8.0),
    ],
    ids=["default", "llama3", "linear"],
)
def test_rope_matches_the_reference(kernels: FusedKernels, rope: RopeConfig) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(2)
    ref = RotaryEmbedding(rope, 128, DEVICE)
    fused = RotaryEmbedding(rope, 128, DEVICE, kernels)
    positions = torch.tensor([0, 1, 17, 500, 4095, 8191], device=DEVICE)
    qkv = torch.randn(6, (16 + 8 + 8) * 128, generator=g, device=DEVICE).to(BF16)
    q = qkv[:, : 16 * 128].view(-1, 16, 128)
    k = qkv[:, 16 * 128 : 24 * 128].view(-1, 8, 128)
    want_q, want_k = ref(positions, q, k)
    got_q, got_k = fused(positions, q, k)
    assert got_q.is_contiguous() and got_k.is_contiguous()  # attention needs no copy of q
    close(got_q, want_q)
    close(got_k, want_k)
    # Layers with the same rope share one table.
    assert RotaryEmbedding(rope, 128, DEVICE, kernels).table is fused.table


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_act_and_mul_matches_the_reference(kernels: FusedKernels, gelu: bool) -> None:
    """The MLP's act(gate) * up on the merged gate/up output (Llama's silu, Gemma's tanh gelu)."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    merged = torch.randn(13, 2 * 3072, generator=g, device=DEVICE).to(BF16) * 2
    gate, up = merged.chunk(2, dim=-1)
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
    got = kernels.act_and_mul(merged, gelu=gelu)
    assert got.shape == (13, 3072)
    close(got, act * up)


def plain_batch(temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> Any:
    """A SamplingBatch of temperatures and seeds only: no penalties, filters or explicit seeds."""
    from tandem.engine.batch import SamplingBatch

    rows = temperature.shape[0]
    return SamplingBatch(
        temperature=temperature,
        top_p=torch.ones(rows, device=DEVICE),
        top_k=torch.zeros(rows, dtype=torch.int64, device=DEVICE),
        min_p=torch.zeros(rows, device=DEVICE),
        seeds=seeds,
        steps=steps,
        presence_penalty=torch.zeros(rows, device=DEVICE),
        frequency_penalty=torch.zeros(rows, device=DEVICE),
        repetition_penalty=torch.ones(rows, device=DEVICE),
        any_top_k_top_p=False,
        any_min_p=False,
        any_explicit_seed=False,
        any_greedy=True,
    )


def test_fused_draw_follows_the_softmax(kernels: FusedKernels) -> None:
    """The sampler's unseeded draw through flashinfer: empirical frequencies match softmax(logits / T),
    filtered (-inf) tokens never come up, greedy rows stay argmax, and the generator moves on."""
    from tandem.engine.sampler import Sampler

    rows, vocab, temperature = 8192, 6, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], device=DEVICE).repeat(rows, 1)
    logits[:, 4] = -float("inf")  # as a top-k / top-p filter leaves it
    temps = torch.full((rows,), temperature, device=DEVICE)
    temps[:64] = 0.0
    zeros = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    batch = plain_batch(temps, zeros, zeros)
    sampler = Sampler(vocab, device=DEVICE, fused_draw=kernels.sample)
    first = sampler(logits, batch).next_tokens
    second = sampler(logits, batch).next_tokens
    assert first.dtype == torch.int64
    assert bool((first[:64] == 5).all()), "greedy rows must stay argmax"
    assert not torch.equal(first[64:], second[64:]), "the generator must advance between draws"
    drawn = torch.cat([first[64:], second[64:]])
    assert not bool((drawn == 4).any()), "a filtered token was drawn"
    freq = torch.bincount(drawn, minlength=vocab).float() / drawn.numel()
    want = torch.softmax(logits[0] / temperature, dim=-1)
    # ~16k draws: the standard error of each frequency is below 0.004.
    torch.testing.assert_close(freq, want, atol=0.02, rtol=0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "cls"),
    [(16, 8, RMSNorm), (4, 1, GemmaRMSNorm), (5, 3, RMSNorm)],
    ids=["qwen3", "gemma3", "heads-not-a-block-multiple"],
)
def test_qk_norm_rope_in_one_launch(
    kernels: FusedKernels, heads: int, kv_heads: int, cls: type[RMSNorm]
) -> None:
    """The Triton q/k norm + rope (qk_norm_rope.py) against the torch reference and flashinfer's three
    kernels it replaces, on the merged projection output, at positions across the table."""
    assert kernels.qk_norm_rope is not None  # CUDA builds of torch bring Triton
    g = torch.Generator(device=DEVICE).manual_seed(3)
    rope = RopeConfig(theta=1e6)
    q_ref, k_ref = (cls(128, 1e-6, dtype=BF16, device=DEVICE) for _ in range(2))
    q_fused, k_fused = (cls(128, 1e-6, dtype=BF16, device=DEVICE, kernels=kernels) for _ in range(2))
    for ref, fused in ((q_ref, q_fused), (k_ref, k_fused)):
        weight = (torch.randn(128, generator=g, device=DEVICE) * 0.2).to(BF16)
        ref.weight.data.copy_(weight)
        fused.weight.data.copy_(weight)
    rotary_ref, rotary = RotaryEmbedding(rope, 128, DEVICE), RotaryEmbedding(rope, 128, DEVICE, kernels)
    assert rotary.table is not None
    positions = torch.tensor([0, 1, 17, 500, 4095, 8191, 3, 3], device=DEVICE)
    qkv = (torch.randn(8, (heads + 2 * kv_heads) * 128, generator=g, device=DEVICE) * 3).to(BF16)
    q, k, _ = qkv.split([heads * 128, kv_heads * 128, kv_heads * 128], dim=-1)
    q, k = q.view(-1, heads, 128), k.view(-1, kv_heads, 128)
    got_q, got_k = kernels.qk_norm_rope(
        qkv,
        positions,
        q_fused.weight,
        k_fused.weight,
        rotary.table,
        num_heads=heads,
        num_kv_heads=kv_heads,
        eps=1e-6,
        gemma=cls.gemma,
    )
    assert got_q.shape == (8, heads, 128) and got_k.shape == (8, kv_heads, 128)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    want_q, want_k = rotary_ref(positions, q_ref(q), k_ref(k))
    close(got_q, want_q)
    close(got_k, want_k)
    chain_q, chain_k = rotary(positions, q_fused(q), k_fused(k))
    close(got_q, chain_q)
    close(got_k, chain_k)


def test_rope_alone_and_its_kv_store_in_one_launch(kernels: FusedKernels) -> None:
    """Without q/k norms (Llama-like) the Triton launch matches flashinfer's rope and the torch one, and
    its store form writes the same rotated k and the untouched v at the given slots of a paged cache,
    nowhere else."""
    assert kernels.qk_norm_rope is not None
    g = torch.Generator(device=DEVICE).manual_seed(4)
    heads, kv_heads, tokens = 32, 8, 6
    rope = RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, original_max_position=8192)
    rotary_ref, rotary = RotaryEmbedding(rope, 128, DEVICE), RotaryEmbedding(rope, 128, DEVICE, kernels)
    assert rotary.table is not None
    positions = torch.tensor([0, 1, 511, 4095, 8191, 7], device=DEVICE)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * 128, generator=g, device=DEVICE) * 3).to(BF16)
    q, k, v = qkv.split([heads * 128, kv_heads * 128, kv_heads * 128], dim=-1)
    q, k = q.view(-1, heads, 128), k.view(-1, kv_heads, 128)
    common: dict[str, Any] = dict(num_heads=heads, num_kv_heads=kv_heads, eps=0.0, gemma=False)
    got_q, got_k = kernels.qk_norm_rope(qkv, positions, None, None, rotary.table, **common)
    # A rotated value is a difference of two products as large as the inputs, so one rounding apart
    # is relative to the inputs' scale, not the result's; a wrong angle or head errs by that whole scale.
    scale = float(qkv.abs().max())
    for want_q, want_k in (rotary(positions, q, k), rotary_ref(positions, q, k)):  # flashinfer, torch
        for got, want in ((got_q, want_q), (got_k, want_k)):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * scale)
    # Against flashinfer's rope, the same float32 math: all but a few values agree exactly.
    flashinfer_q, _ = rotary(positions, q, k)
    assert float((got_q == flashinfer_q).float().mean()) > 0.99
    for slot_dtype in (torch.int32, torch.int64):  # decode graphs' slots, and eager batches'
        k_cache = torch.zeros(64, kv_heads, 128, dtype=BF16, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.tensor([5, 63, 0, 17, 18, 40], dtype=slot_dtype, device=DEVICE)
        stored_q, _ = kernels.qk_norm_rope(
            qkv, positions, None, None, rotary.table, kv_cache=(k_cache, v_cache, slots), **common
        )
        assert torch.equal(stored_q, got_q)
        assert torch.equal(k_cache[slots.long()], got_k)
        assert torch.equal(v_cache[slots.long()], v.reshape(tokens, kv_heads, 128))
        others = torch.ones(64, dtype=torch.bool, device=DEVICE)
        others[slots.long()] = False
        assert not k_cache[others].any() and not v_cache[others].any()


def test_one_pass_race_follows_the_softmax(kernels: FusedKernels) -> None:
    """The sampler's one-pass race (sampling_race.py) on bf16 logits of a padded LM head: frequencies
    match softmax(logits / T), a -inf token never comes up, greedy rows stay argmax, and the tokens are
    the torch race's for the same seeds and steps (bar near-ties, where GPU `log` rounds otherwise)."""
    from tandem.engine.sampler import Sampler

    assert kernels.race_sample is not None  # CUDA builds of torch bring Triton
    rows, vocab, temperature = 16384, 6, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 9.0, 9.0], device=DEVICE).repeat(rows, 1)
    logits[:, 4] = -float("inf")
    logits = logits.to(BF16)  # columns 6 and 7 are the head's padding, past the vocabulary
    temps = torch.full((rows,), temperature, device=DEVICE)
    temps[:64] = 0.0
    seeds = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 7919 + 1
    batch = plain_batch(temps, seeds, torch.full((rows,), 3, dtype=torch.int64, device=DEVICE))
    drawn = Sampler(vocab, device=DEVICE, race=kernels.race_sample)(logits, batch).next_tokens
    assert drawn.dtype == torch.int64
    assert bool((drawn[:64] == 5).all()), "greedy rows must stay argmax"
    assert int(drawn.max()) < vocab, "a padding column was drawn"
    assert not bool((drawn == 4).any()), "a -inf token was drawn"
    freq = torch.bincount(drawn[64:], minlength=vocab).float() / (rows - 64)
    want = torch.softmax(logits[0, :vocab].float() / temperature, dim=-1)
    torch.testing.assert_close(freq, want, atol=0.02, rtol=0)  # standard error below 0.004
    seeded = dataclasses.replace(batch, any_explicit_seed=True)
    torch_race = Sampler(vocab, device=DEVICE)(logits, seeded).next_tokens  # the counter-based hash
    assert float((torch_race == drawn).float().mean()) > 0.999


def test_one_pass_race_masks_structured_rows_inside_the_kernel(kernels: FusedKernels) -> None:
    """A batch with structured-output rows takes the one-pass race too: the race reads their bitmask
    beside the bf16 logits (ids past the tokenizer's blocked) and writes no logits, and the tokens are the
    torch race's over the same masked logits (bar near-ties, as above)."""
    from tandem.engine.sampler import Sampler

    assert kernels.race_sample is not None
    rows, head, tokenizer_vocab = 64, 2048, 1500
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(rows, head, generator=g, device=DEVICE) * 3).to(BF16)
    constrained = torch.arange(1, rows, 3, device=DEVICE)
    allowed = torch.rand(constrained.shape[0], head, generator=g, device=DEVICE) < 0.05
    allowed[:, tokenizer_vocab:] = True  # the mask says yes; the tokenizer's width must still block them
    bits = allowed[:, :tokenizer_vocab]
    words = -(-tokenizer_vocab // 32)
    padded = torch.zeros(constrained.shape[0], words * 32, dtype=torch.bool, device=DEVICE)
    padded[:, :tokenizer_vocab] = bits
    weights = 2 ** torch.arange(32, dtype=torch.int64, device=DEVICE)
    bitmask = (padded.view(-1, words, 32).long() * weights).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    temps = torch.full((rows,), 0.8, device=DEVICE)
    temps[::5] = 0.0
    seeds = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 31 + 7
    batch = dataclasses.replace(
        plain_batch(temps, seeds, torch.full((rows,), 2, dtype=torch.int64, device=DEVICE)),
        bitmask=bitmask,
        bitmask_rows=constrained,
        bitmask_vocab=tokenizer_vocab,
    )
    original = logits.clone()
    drawn = Sampler(head, device=DEVICE, race=kernels.race_sample)(logits, batch).next_tokens
    assert torch.equal(logits, original), "the race wrote into the logits"
    chosen = drawn[constrained]
    assert bool((chosen < tokenizer_vocab).all()), "an id past the tokenizer was drawn"
    assert bool(bits.gather(1, chosen[:, None]).all()), "a masked token was drawn"
    seeded = dataclasses.replace(batch, any_explicit_seed=True)
    torch_race = Sampler(head, device=DEVICE)(original, seeded).next_tokens  # float32 copy, then the race
    assert float((torch_race == drawn).float().mean()) > 0.95
