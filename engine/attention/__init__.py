"""Attention backends by name, imported lazily so flashinfer is never imported on CPU."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tandem.engine.attention.base import AttentionBackend, LayerSpec

# name -> "module:factory"; the factory takes (groups, page_size, device, **options).
_BACKENDS: dict[str, str] = {
    "torch": "tandem.engine.attention.torch_backend:TorchAttentionBackend",
    # The paged backend, or its MLA option where the layers are latent (flashinfer_mla.py).
    "flashinfer": "tandem.engine.attention.flashinfer_mla:flashinfer_backend",
}


def backend_factory(name: str) -> Callable[..., Any]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: {', '.join(_BACKENDS)}")
    module, attr = _BACKENDS[name].split(":")
    factory: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return factory


__all__ = ["AttentionBackend", "LayerSpec", "backend_factory"]
