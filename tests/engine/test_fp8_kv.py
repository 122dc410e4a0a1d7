"""The FP8 KV cache on CPU (the reference attention reads it as flashinfer does: stored / scale, saturated,
multiplied back): the pool's encode and read, checkpoint scales by layer, pages half the bytes, a model
run close to the 16-bit cache's logits, and the capacity line `tandem serve` prints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.deploy.cli.kv_capacity import kv_capacity_message
from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.kv_pool import KVGroupSpec, KVPool
from tandem.engine.quant.fp8_format import layer_kv_scales
from tandem.engine.streams import StreamSet
from tandem.scheduler.kv_manager import GroupInfo
from tandem.scheduler.runtime import RuntimeLimits

FP8 = torch.float8_e4m3fn


def _pool(dtype: torch.dtype, scales: dict[int, tuple[float, float]] | None = None) -> KVPool:
    group = KVGroupSpec(0, (0, 1), None, 8)
    return KVPool([group], 4, 2, 16, dtype=dtype, device=torch.device("cpu"), scales=scales)


def test_pool_stores_scaled_fp8_and_reads_it_back() -> None:
    pool = _pool(FP8, {1: (2.0, 0.25)})
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    k[0, 0, 0] = 5000.0  # beyond FP8's range even after the scale: saturates, never inf or nan
    loc = torch.tensor([1, 6, 9])
    pool.store(1, loc, k, v)
    assert torch.equal(pool.k[1][loc].float(), (k / 2.0).clamp(-448, 448).to(FP8).float())
    assert torch.equal(pool.v[1][loc].float(), (v / 0.25).clamp(-448, 448).to(FP8).float())
    kb, vb = pool.gather(1, loc, torch.float32)
    assert float(kb[0, 0, 0]) == 896.0  # 448 x 2
    # FP8 e4m3 keeps 3 mantissa bits: each value within half a step, 1/16 of its magnitude.
    inside = k.abs() < 100
    assert bool(((kb - k).abs() <= k.abs() / 16 + 1e-3)[inside].all())
    assert bool(((vb - v).abs() <= v.abs() / 16 + 1e-3).all())
    assert pool.scales[0] == (1.0, 1.0)  # no checkpoint scale: 1.0
    # Power-of-two scales shift FP8's exponent only: the same values come back as with scales of 1.
    unscaled = _pool(FP8)
    unscaled.store(1, loc, k, v)
    ku, vu = unscaled.gather(1, loc, torch.float32)
    assert torch.equal(kb[inside], ku[inside]) and torch.equal(vb, vu)
    assert _pool(FP8).bytes_per_page() * 2 == _pool(torch.bfloat16).bytes_per_page()


def test_checkpoint_kv_scales_by_layer() -> None:
    found = layer_kv_scales(
        {
            "model.layers.0.self_attn.k_scale": 0.5,
            "model.layers.0.self_attn.v_scale": 2.0,
            "model.layers.3.self_attn.k_proj.k_scale": 4.0,
        }
    )
    assert found == {0: (0.5, 2.0), 3: (4.0, 1.0)}


def _prefill_logits(model_dir: Path, prompt: list[int], **options: object) -> torch.Tensor:
    """Last-token logits of one prefill through the engine; attention reads the prompt's K/V back from
    the pool, so an FP8 pool shows in them."""
    from tandem.engine.batch import AttentionGroupBatch, ForwardBatch, SamplingBatch
    from tandem.engine.models.context import ForwardContext

    config = resolve_engine_config(model_dir, device="cpu", page_size=4, num_pages=64, **options)
    engine = Engine(config, TPGroup(), StreamSet(torch.device("cpu")))
    n = len(prompt)
    table = torch.arange(3, 3 + 32, dtype=torch.int32).unsqueeze(0)
    pos = torch.arange(n)
    loc = table[0].long()[pos // 4] * 4 + pos % 4
    zero = torch.zeros(1, dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    group = AttentionGroupBatch(table, zero, loc, zero, table)
    batch = ForwardBatch(
        torch.tensor(prompt), pos, lens, lens, lens, lens, (group,) * len(engine.groups),
        SamplingBatch.greedy(1), False,
    )  # fmt: skip
    engine.attention.plan(batch)
    with torch.inference_mode():
        hidden = engine.model(batch.input_ids, batch.positions, ForwardContext(engine.attention, engine.pool))
        return engine.model.compute_logits(hidden[-1:])[0]


def test_fp8_cache_runs_close_to_the_16_bit_one(tiny_model_dir: Callable[..., Path]) -> None:
    model_dir = tiny_model_dir("qwen3")
    prompt = [5, 9, 33, 120, 7, 8, 200, 41, 3, 77, 15, 16] * 3
    plain = _prefill_logits(model_dir, prompt)
    fp8 = _prefill_logits(model_dir, prompt, kv_cache_dtype="fp8_e4m3")
    rel = float((fp8 - plain).norm() / plain.norm())
    # Really read through FP8, and only FP8's rounding apart (3 mantissa bits against float32's 23, in a
    # random 2-layer model whose 16-bit run is already 4 % off float32).
    assert 0 < rel < 0.5, rel
    llm = LLM(str(model_dir), device="cpu", kv_cache_dtype="fp8_e4m3")
    engine = llm.runtime.engine
    assert engine.pool.fp8 and engine.pool.k[0].dtype == FP8
    assert engine.config.switches()["kv_cache_dtype"] == "float8_e4m3fn"
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([prompt], params, use_tqdm=False)[0].token_ids) == 16


def test_capacity_line() -> None:
    limits = RuntimeLimits([GroupInfo(0, None, 1000), GroupInfo(1, 512, 400)], 16, 8192, 4096, 1000, 64)
    line = kv_capacity_message(limits, "fp8_e4m3")
    assert line == "KV cache: 16,000 tokens per replica (1,000 pages of 16 tokens, fp8_e4m3)"
    assert "model dtype" in kv_capacity_message(limits)


def test_resolved_config_keeps_the_fp8_cache(tmp_path: Path) -> None:
    config = resolve_engine_config(tmp_path, device="cpu", kv_cache_dtype="fp8_e4m3")
    assert config.kv_cache_dtype == FP8
    assert resolve_engine_config(tmp_path, device="cpu").kv_cache_dtype is None
