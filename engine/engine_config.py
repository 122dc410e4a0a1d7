"""The engine's resolved configuration: every "auto" is settled here, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings after resolution. `num_pages` None means: size the pool from free memory."""

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    page_size: int
    num_pages: int | None
    mem_fraction: float = 0.85
    attention_backend: str = "torch"
    cuda_graph: bool = False
    copy_stream: bool = True
    max_batch_size: int = 256


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


def resolve_engine_config(
    model_dir: Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    page_size: int | None = None,
    num_pages: int | None = None,
    mem_fraction: float = 0.85,
    cuda_graph: bool = True,
    copy_stream: bool = True,
    kv_tokens_cpu: int = 32768,
) -> EngineConfig:
    dev = resolve_device(device)
    if page_size is not None and page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not 0.0 < mem_fraction < 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1), got {mem_fraction}")
    on_gpu = dev.type == "cuda"
    # flashinfer and CUDA graphs like 16-token pages; on CPU small pages keep tiny pools fine-grained.
    resolved_page = page_size or (16 if on_gpu else 4)
    if num_pages is None and not on_gpu:
        num_pages = max(1, kv_tokens_cpu // resolved_page)
    return EngineConfig(
        model_dir=model_dir,
        device=dev,
        dtype=resolve_dtype(dtype, dev),
        page_size=resolved_page,
        num_pages=num_pages,
        mem_fraction=mem_fraction,
        attention_backend="torch",  # the flashinfer backend arrives with the GPU path
        cuda_graph=cuda_graph and on_gpu,
        copy_stream=copy_stream and on_gpu,
    )
