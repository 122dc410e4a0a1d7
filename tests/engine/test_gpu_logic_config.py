"""The GPU path, checked on CPU: switch resolution, recorded switches, and the lazy flashinfer import."""

from __future__ import annotations

import py_compile
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.engine.attention import backend_factory
from tandem.engine.engine_config import DeviceFacts, resolve_backend, resolve_engine_config
from tandem.scheduler.runtime import RuntimeOptions

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_resolves_to_the_reference_path(tmp_path: Path) -> None:
    config = resolve_engine_config(tmp_path, device="cpu")
    switches = config.switches()
    assert switches["attention_backend"] == "torch"
    assert switches["cuda_graph"] is False and switches["piecewise_cuda_graph"] is False
    assert switches["copy_stream"] is False
    assert switches["dtype"] == "float32" and switches["device"] == "cpu"
    assert set(switches) >= {"cuda_graph_max_bs", "piecewise_max_tokens", "page_size"}
    # The one-launch decode lives in decode graphs: off wherever they are off, whatever was asked.
    assert switches["fused_decode_max_bs"] == 0
    assert resolve_engine_config(tmp_path, device="cpu", fused_decode_max_bs=8).fused_decode_max_bs == 0
    # So are PDL and tinygemm, which live in CUDA graphs too.
    on = resolve_engine_config(tmp_path, device="cpu", pdl_max_bs=8, small_gemm_max_bs=8).switches()
    assert on["pdl_max_bs"] == 0 and on["small_gemm_max_bs"] == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attention_backend": "flashinfer"}, "CUDA"),
        ({"attention_backend": "triton"}, "attention_backend"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
        ({"piecewise_max_tokens": -1}, "piecewise_max_tokens"),
        ({"fused_decode_max_bs": -1}, "fused_decode_max_bs"),
        ({"fused_decode_max_bs": 2.5}, "fused_decode_max_bs"),
        ({"fused_decode_max_bs": 64}, "fused_decode_max_bs"),  # the work-list sizes are gone
        ({"dtype": "float64"}, "dtype"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
        ({"mem_fraction": 1.0}, "mem_fraction"),
        ({"pdl_max_bs": -1}, "pdl_max_bs"),
        ({"small_gemm_max_bs": True}, "small_gemm_max_bs"),
    ],
)
def test_bad_switches_fail_at_the_edge(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_engine_config(tmp_path, device="cpu", **kwargs)  # type: ignore[arg-type]


def test_runtime_options_validate_graph_sizes() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        RuntimeOptions.of(cuda_graph_max_bs=0)
    RuntimeOptions.of(attention_backend="torch", piecewise_cuda_graph=False)
    with pytest.raises(ValueError, match="fused_decode_max_bs"):
        RuntimeOptions.of(fused_decode_max_bs=-1)
    RuntimeOptions.of(fused_decode_max_bs=0)
    for name in ("pdl_max_bs", "small_gemm_max_bs"):
        with pytest.raises(ValueError, match=name):
            RuntimeOptions.of(**{name: -1})
        RuntimeOptions.of(**{name: 0})
    with pytest.raises(ValueError, match="chunk_size"):
        RuntimeOptions.of(chunk_size=0)
    with pytest.raises(TypeError, match="work_waves"):
        RuntimeOptions.of(work_waves=4)


def test_flashinfer_is_never_imported_on_the_cpu_path() -> None:
    backend_factory("torch")
    assert "tandem.engine.attention.flashinfer_backend" not in sys.modules
    assert "flashinfer" not in sys.modules or torch.cuda.is_available()


def test_gpu_only_modules_compile() -> None:
    for name in (
        "engine/attention/flashinfer_backend.py",
        "engine/cuda_graph.py",
        "engine/piecewise_graph.py",
        "engine/attention/triton_decode.py",
        "engine/layers/triton_norm.py",
    ):
        py_compile.compile(str(ROOT / name), doraise=True)


def test_flashinfer_only_for_head_sizes_it_serves() -> None:
    cuda = torch.device("cuda")  # a device object only; nothing runs on it
    with pytest.raises(ValueError, match="head_dim"):
        resolve_backend("flashinfer", cuda, 16)
    assert resolve_backend("auto", cuda, 16) == "torch"  # the tiny test models
    assert resolve_backend("torch", cuda, 128) == "torch"
    assert resolve_backend("auto", torch.device("cpu"), 128) == "torch"


def test_latent_attention_takes_flashinfer_where_its_mla_kernels_fit(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """DeepSeek's 512 + 64 latent goes to flashinfer (its MLA option) on a stated Hopper; the tiny
    models' 32 + 8 latent to the torch reference; flashinfer's MLA module compiles."""
    facts = DeviceFacts(cuda=True, capability=(9, 0), num_sms=132, flashinfer=True, triton=True)
    real = tiny_model_dir("deepseek_v2", kv_lora_rank=512, qk_rope_head_dim=64)
    assert resolve_engine_config(real, facts=facts).attention_backend == "flashinfer"
    assert resolve_engine_config(tiny_model_dir("deepseek_v3"), facts=facts).attention_backend == "torch"
    py_compile.compile(str(ROOT / "engine/attention/flashinfer_mla.py"), doraise=True)


@pytest.mark.parametrize(("compiled", "sources_exist", "expected"), [
    (False, True, True), (False, False, False), (True, False, True),
])  # fmt: skip
def test_the_fp8_block_gemm_counts_only_where_it_can_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool, sources_exist: bool, expected: bool
) -> None:
    """flashinfer stands in at the edge (it is not installed on CPU): an install that imports the block
    GEMM but lacks its CUDA sources, and has not built it, takes scaled_mm instead of failing later."""
    import types

    source = tmp_path / "fp8_blockscale_gemm.cu"
    if sources_exist:
        source.write_text("")
    spec = types.SimpleNamespace(is_compiled=compiled, sources=[source])
    gemm = types.ModuleType("flashinfer.gemm")
    gemm.fp8_blockscale_gemm_sm90 = lambda *args: None  # type: ignore[attr-defined]
    jit = types.ModuleType("flashinfer.jit.gemm.fp8_blockscale")
    jit.gen_fp8_blockscale_gemm_sm90_module = lambda: spec  # type: ignore[attr-defined]
    for name, module in {
        "flashinfer": types.ModuleType("flashinfer"),
        "flashinfer.gemm": gemm,
        "flashinfer.jit": types.ModuleType("flashinfer.jit"),
        "flashinfer.jit.gemm": types.ModuleType("flashinfer.jit.gemm"),
        "flashinfer.jit.gemm.fp8_blockscale": jit,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    from tandem.engine.engine_config import fp8_block_gemm_buildable

    assert fp8_block_gemm_buildable() is expected
