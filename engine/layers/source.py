"""A checkpoint tensor that can be read in slices, so a rank reads only its own shard."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class TensorSource(Protocol):
    """What a parameter loader reads from: a shape, and sliced reads along one dimension."""

    name: str

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor: ...


class SafetensorsSource:
    """A lazy view of one tensor in an open safetensors file (`safe_open(...).get_slice(name)`)."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self._slice = handle.get_slice(name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self._slice.get_shape())

    def read(self, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
        shape = self.shape
        if size is None and start == 0:
            return self._slice[:]  # type: ignore[no-any-return]
        end = shape[dim] if size is None else start + size
        index = tuple(slice(start, end) if d == dim else slice(None) for d in range(len(shape)))
        return self._slice[index]  # type: ignore[no-any-return]


class InMemorySource:
    """A tensor already in memory (tests, and checkpoints converted on the fly)."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name
        self._tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._tensor.shape)

    def read(self, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
        end = self._tensor.shape[dim] if size is None else start + size
        return self._tensor.narrow(dim, start, end - start)


def check_shape(source: TensorSource, expected: tuple[int, ...], what: str) -> None:
    if source.shape != expected:
        raise ValueError(
            f"checkpoint tensor {source.name!r} has shape {list(source.shape)}, "
            f"but {what} expects {list(expected)}"
        )
