"""The engine's resolved configuration: every "auto" is settled here, once."""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BACKENDS = ("auto", "torch", "flashinfer")
# The head sizes flashinfer's kernels are built and tested for.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
# Decode graphs of up to this many rows take the one-launch decode by default (see EngineConfig).
FUSED_DECODE_MAX_BS = 32
# Graphs of up to this many rows launch their Triton kernels with PDL by default (see EngineConfig).
PDL_MAX_BS = 8
# Graphs' GEMMs of up to this many rows run as flashinfer's tinygemm by default (see EngineConfig).
SMALL_GEMM_MAX_BS = 8


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings after resolution. `num_pages` None means: size the pool from free memory.

    The switches are already what runs: `cuda_graph` is False on CPU or with the torch backend, and
    so on. `switches()` records them with benchmark results.
    """

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    page_size: int
    num_pages: int | None
    mem_fraction: float = 0.85
    attention_backend: str = "torch"
    cuda_graph: bool = False  # full CUDA graphs for decode batches
    piecewise_cuda_graph: bool = False  # CUDA graphs of the pieces between attention calls (prefill)
    copy_stream: bool = True  # device-to-host result copies on their own stream
    fused_kernels: bool = False  # flashinfer's fused norm and rope kernels instead of torch ops
    cuda_graph_max_bs: int = 256  # largest decode batch with a graph; larger ones run eagerly
    piecewise_max_tokens: int = 2048  # largest prefill/extend batch with piecewise graphs
    # Decode graphs of up to this many rows run each full-attention layer's rope, K/V store, attention
    # and split merge as one Triton launch (attention/triton_decode.py; above 32 rows over a work list,
    # attention/decode_work.py), and graphs' norms over up to this many rows, at most 32, run as Triton
    # kernels (layers/triton_norm.py); 0 turns both off.
    fused_decode_max_bs: int = 0
    # CUDA graphs of up to this many rows launch their Triton kernels (and tinygemm) with programmatic
    # dependent launch (layers/pdl.py); 0 turns it off. Never more than `fused_decode_max_bs`.
    pdl_max_bs: int = 0
    # CUDA graphs' GEMMs of up to this many rows run as flashinfer's tinygemm (FusedKernels.linear).
    small_gemm_max_bs: int = 0
    max_batch_size: int = 256

    def switches(self) -> dict[str, object]:
        """The engine's ablation switches as plain values, for benchmark result files."""
        return {
            "attention_backend": self.attention_backend,
            "cuda_graph": self.cuda_graph,
            "piecewise_cuda_graph": self.piecewise_cuda_graph,
            "copy_stream": self.copy_stream,
            "fused_kernels": self.fused_kernels,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "piecewise_max_tokens": self.piecewise_max_tokens,
            "fused_decode_max_bs": self.fused_decode_max_bs,
            "pdl_max_bs": self.pdl_max_bs,
            "small_gemm_max_bs": self.small_gemm_max_bs,
            "page_size": self.page_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _flashinfer_importable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # an incomplete install fails with anything, not only ImportError
        warnings.warn(f"flashinfer is unavailable ({exc!r}); using the torch attention backend", stacklevel=3)
        return False
    return True


def resolve_backend(name: str, device: torch.device, head_dim: int | None = None) -> str:
    """'auto' is flashinfer on CUDA when it imports and serves the head size, else the torch reference."""
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(_BACKENDS)}, got {name!r}")
    on_gpu = device.type == "cuda"
    if name == "flashinfer" and not on_gpu:
        raise ValueError("attention_backend='flashinfer' needs a CUDA device")
    served = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    if name == "flashinfer" and not served:
        raise ValueError(
            f"attention_backend='flashinfer' serves head_dim {FLASHINFER_HEAD_DIMS}, got {head_dim}"
        )
    if name == "auto":
        # The tiny test models and the demo model (head_dim 16 and 32) take the torch backend on GPU too.
        return "flashinfer" if on_gpu and served and _flashinfer_importable() else "torch"
    return name


def _head_dim(model_dir: Path) -> int | None:
    try:
        return ModelConfig.from_dir(model_dir).head_dim
    except (FileNotFoundError, ValueError, KeyError):
        return None  # the engine reports a broken model directory properly when it loads it


def resolve_engine_config(
    model_dir: Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    page_size: int | None = None,
    num_pages: int | None = None,
    mem_fraction: float = 0.85,
    attention_backend: str = "auto",
    cuda_graph: bool = True,
    piecewise_cuda_graph: bool = True,
    copy_stream: bool = True,
    fused_kernels: bool = True,
    cuda_graph_max_bs: int = 256,
    piecewise_max_tokens: int = 2048,
    fused_decode_max_bs: int = FUSED_DECODE_MAX_BS,
    pdl_max_bs: int = PDL_MAX_BS,
    small_gemm_max_bs: int = SMALL_GEMM_MAX_BS,
    kv_tokens_cpu: int = 32768,
) -> EngineConfig:
    dev = resolve_device(device)
    if page_size is not None and page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not 0.0 < mem_fraction < 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1), got {mem_fraction}")
    for name, value in (
        ("cuda_graph_max_bs", cuda_graph_max_bs),
        ("piecewise_max_tokens", piecewise_max_tokens),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (
        ("fused_decode_max_bs", fused_decode_max_bs),
        ("pdl_max_bs", pdl_max_bs),
        ("small_gemm_max_bs", small_gemm_max_bs),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    on_gpu = dev.type == "cuda"
    backend = resolve_backend(attention_backend, dev, _head_dim(model_dir) if on_gpu else None)
    # flashinfer and CUDA graphs like 16-token pages; on CPU small pages keep tiny pools fine-grained.
    resolved_page = page_size or (16 if on_gpu else 4)
    if num_pages is None and not on_gpu:
        num_pages = max(1, kv_tokens_cpu // resolved_page)
    graphs = cuda_graph and on_gpu and backend == "flashinfer"
    # PDL's grid-dependency instructions and tinygemm's TMA loads need Hopper (compute capability 9.0).
    hopper = graphs and torch.cuda.get_device_capability(dev)[0] >= 9
    fused = fused_kernels and backend == "flashinfer"
    return EngineConfig(
        model_dir=model_dir,
        device=dev,
        dtype=resolve_dtype(dtype, dev),
        page_size=resolved_page,
        num_pages=num_pages,
        mem_fraction=mem_fraction,
        attention_backend=backend,
        # Decode graphs need an attention backend that plans into fixed buffers (flashinfer).
        cuda_graph=graphs,
        piecewise_cuda_graph=piecewise_cuda_graph and on_gpu,
        copy_stream=copy_stream and on_gpu,
        # Same condition as the backend: flashinfer imports and serves the head size.
        fused_kernels=fused,
        cuda_graph_max_bs=cuda_graph_max_bs,
        piecewise_max_tokens=piecewise_max_tokens,
        # The one-launch decode lives inside decode graphs and is one of the fused kernels.
        fused_decode_max_bs=fused_decode_max_bs if graphs and fused else 0,
        # Both live inside CUDA graphs, with the fused kernels, on Hopper and later; PDL only for the
        # Triton kernels' rows.
        pdl_max_bs=min(pdl_max_bs, fused_decode_max_bs) if hopper and fused else 0,
        small_gemm_max_bs=small_gemm_max_bs if hopper and fused else 0,
    )
