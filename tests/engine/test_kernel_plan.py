"""Kernel plans on CPU, for devices the test only describes: the plan of each captured shape must pick
exactly what the per-call checks of the engine before plans picked (the one-launch decode up to 32 decode
rows, Triton norms and activation in graphs of up to 32 rows, PDL and tinygemm up to 8 on Hopper, nothing
of it eagerly), the Triton GEMV takes graphs of one row where PDL runs, and the layers must follow the
plan they are handed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.engine_config import DeviceFacts, EngineConfig, resolve_engine_config
from tandem.engine.graph_buckets import decode_batch_sizes, token_buckets
from tandem.engine.kernel_plan import EAGER, KernelPlan, KernelPlanner
from tandem.engine.options import FUSED_DECODE_MAX_BS

H200 = DeviceFacts(cuda=True, capability=(9, 0), num_sms=132, flashinfer=True, triton=True, tinygemm=True)
NO_TRITON = DeviceFacts(cuda=True, capability=(9, 0), num_sms=132, flashinfer=True)
A100 = DeviceFacts(cuda=True, capability=(8, 0), num_sms=108, flashinfer=True, triton=True, tinygemm=True)


def _config(tmp_path: Path, facts: DeviceFacts, **options: object) -> EngineConfig:
    return resolve_engine_config(tmp_path, facts=facts, **options)


def _legacy_decode(config: EngineConfig, bs: int) -> KernelPlan:
    """What the engine before plans did in the decode graph of `bs` rows, clause by clause: the backend
    built one-launch buffers for sizes <= fused_decode_max_bs where Triton imported; FusedKernels took its
    Triton norms while `_in_graphs` for 2D inputs of rows <= min(fused_decode_max_bs, 32), PDL for rows <=
    pdl_max_bs, and tinygemm for 0 < rows <= small_gemm_max_bs (with tinygemm importable). Added since: the
    Triton GEMV for 0 < rows <= gemv_max_bs, and PDL for the LoRA kernels in every graph where PDL runs."""
    return KernelPlan(
        rows=bs,
        fused_decode=config.triton and bs <= config.fused_decode_max_bs,
        triton_norms=config.triton and bs <= min(config.fused_decode_max_bs, 32),
        pdl=bs <= config.pdl_max_bs,
        tinygemm=0 < bs <= config.small_gemm_max_bs,
        gemv=0 < bs <= config.gemv_max_bs,
        lora_pdl=config.pdl_max_bs > 0,
    )


def test_hopper_defaults_resolve_to_todays_limits(tmp_path: Path) -> None:
    config = _config(tmp_path, H200)
    assert config.attention_backend == "flashinfer" and config.cuda_graph and config.triton
    assert (config.fused_decode_max_bs, config.pdl_max_bs, config.small_gemm_max_bs) == (32, 8, 8)
    assert config.gemv_max_bs == 1


def test_float32_on_cuda_takes_the_torch_reference_path(tmp_path: Path) -> None:
    # flashinfer's attention, norm and rope kernels take 16-bit tensors: a float32 run never reaches them.
    config = _config(tmp_path, H200, dtype="float32")
    assert config.attention_backend == "torch" and not config.cuda_graph
    assert not config.fused_kernels and not config.triton and config.pdl_max_bs == 0
    assert _config(tmp_path, H200, dtype="float16").fused_kernels
    with pytest.raises(ValueError, match="bfloat16 and float16"):
        _config(tmp_path, H200, dtype="float32", attention_backend="flashinfer")


def test_hopper_plans_per_decode_graph(tmp_path: Path) -> None:
    config = _config(tmp_path, H200)
    planner = KernelPlanner.from_config(config)
    for bs in decode_batch_sizes(config.cuda_graph_max_bs):
        plan = planner.decode(bs)
        assert plan == _legacy_decode(config, bs), bs
        assert plan.fused_decode == (bs <= 32) and plan.triton_norms == (bs <= 32)
        assert plan.pdl == (bs <= 8) and plan.tinygemm == (bs <= 8) and plan.gemv == (bs == 1)


def test_hopper_plans_per_piecewise_bucket(tmp_path: Path) -> None:
    planner = KernelPlanner.from_config(_config(tmp_path, H200))
    for tokens in token_buckets(2048):
        plan = planner.piecewise(tokens)
        # Attention runs between the pieces, so never the one launch; the rest by token count.
        assert not plan.fused_decode
        assert (plan.triton_norms, plan.pdl, plan.tinygemm) == (tokens <= 32, tokens <= 8, tokens <= 8)
        assert plan.gemv == (tokens == 1)


def test_eager_plan_runs_none_of_the_graph_kernels() -> None:
    assert KernelPlan(rows=0) == EAGER
    assert not (EAGER.fused_decode or EAGER.triton_norms or EAGER.pdl or EAGER.tinygemm or EAGER.gemv)


@pytest.mark.parametrize(
    ("facts", "options", "limits"),
    [
        (A100, {}, (32, 0, 0, 0)),  # PDL, tinygemm and so the GEMV need Hopper
        (NO_TRITON, {}, (0, 8, 0, 0)),
        (H200, {"fused_decode_max_bs": 4}, (4, 4, 8, 1)),  # PDL never above the one launch's rows
        (H200, {"gemv_max_bs": 4}, (32, 8, 8, 4)),
        (H200, {"gemv_max_bs": 16}, (32, 8, 8, 8)),  # the GEMV never above PDL's rows
        (H200, {"pdl_max_bs": 0}, (32, 0, 8, 0)),
        (H200, {"cuda_graph": False}, (0, 0, 0, 0)),
        (H200, {"fused_kernels": False}, (0, 0, 0, 0)),
        (H200, {"attention_backend": "torch"}, (0, 0, 0, 0)),
        (DeviceFacts(), {}, (0, 0, 0, 0)),  # CPU
    ],
)
def test_limits_follow_the_device_and_options(
    tmp_path: Path, facts: DeviceFacts, options: dict[str, object], limits: tuple[int, int, int, int]
) -> None:
    config = _config(tmp_path, facts, **options)
    resolved = (config.fused_decode_max_bs, config.pdl_max_bs, config.small_gemm_max_bs, config.gemv_max_bs)
    assert resolved == limits
    planner = KernelPlanner.from_config(config)
    for bs in decode_batch_sizes(64):
        assert planner.decode(bs) == _legacy_decode(config, bs), (facts, options, bs)


def test_fused_decode_is_capped_where_it_was_measured() -> None:
    assert FUSED_DECODE_MAX_BS == 32


def test_layers_follow_the_plan_on_cpu() -> None:
    """Without FusedKernels (CPU) a plan changes nothing: graph plans and EAGER give the same output."""
    import torch

    from tandem.engine.distributed import TPGroup
    from tandem.engine.layers.linear import ColumnParallelLinear, even_shard
    from tandem.engine.layers.norm import RMSNorm

    torch.manual_seed(0)
    lin = ColumnParallelLinear(
        16, [even_shard(8, TPGroup())], bias=False, dtype=torch.float32, device=torch.device("cpu")
    )
    lin.weight.data.normal_()
    assert not lin.tinygemm_fits and not lin.gemv_fits
    norm = RMSNorm(8, 1e-6, dtype=torch.float32, device=torch.device("cpu"))
    x = torch.randn(3, 16)
    plan = KernelPlanner(32, 32, 8, 8, 4).decode(4)
    assert plan.tinygemm and plan.triton_norms and plan.gemv
    assert torch.equal(lin(x, plan), lin(x)) and torch.equal(norm(lin(x), plan), norm(lin(x)))


def test_fp8_kv_cache_turns_the_one_launch_off_only(tmp_path: Path) -> None:
    """The one-launch decode reads and writes 16-bit caches: over an FP8 pool every plan leaves it to
    flashinfer, and keeps the Triton norms, PDL and tinygemm where they were."""
    config = _config(tmp_path, H200, kv_cache_dtype="fp8_e4m3")
    planner = KernelPlanner.from_config(config)
    for bs in decode_batch_sizes(64):
        plan = planner.decode(bs)
        assert not plan.fused_decode
        assert (plan.triton_norms, plan.pdl, plan.tinygemm) == (bs <= 32, bs <= 8, bs <= 8)
        assert plan.gemv == (bs == 1)


@pytest.mark.parametrize(
    ("facts", "options", "gemm"),
    [
        (dataclasses.replace(H200, fp8_block_gemm=True), {"quantization": "fp8"}, "block"),
        (H200, {"quantization": "fp8"}, "scaled_mm"),  # a flashinfer without the block-scaled GEMM
        (dataclasses.replace(H200, fp8_block_gemm=True), {}, None),  # no FP8 layers
        (DeviceFacts(), {"quantization": "fp8"}, None),  # CPU: dequantized weights, no FP8 GEMM
    ],
)
def test_fp8_gemm_follows_the_device(
    tmp_path: Path, facts: DeviceFacts, options: dict[str, Any], gemm: str | None
) -> None:
    assert _config(tmp_path, facts, **options).fp8_gemm == gemm
