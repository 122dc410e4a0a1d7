"""One host buffer and one host-to-device copy for all the arrays a batch sends to the device.

A decode batch carries about twenty small arrays (token-pool indices, positions, lengths, page tables,
sampling parameters). Pinning and copying each on its own costs tens of microseconds of host time
apiece, which at large batch is a visible share of the step; packed, it is one pinned allocation and
one `cudaMemcpyAsync`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

# bytes: every array starts on a 16-byte boundary. Triton compiles a kernel variant per pointer
# alignment (16 or not), so with 8-byte packing the engine's Triton kernels (the sampling race, the q/k
# norm + rope) saw a new alignment mix whenever the batch size changed, and rebuilt mid-run.
_ALIGN = 16
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


@dataclass(frozen=True)
class Staged:
    """The added arrays as tensors: on the host (the arrays themselves on CUDA; views of the packed buffer
    on CPU) and on the device (views of the packed buffer's device copy)."""

    host: list[torch.Tensor]
    device: list[torch.Tensor]


class Staging:
    """Collects arrays with `add` (which returns the array's index), then packs and sends them.

    On CPU the device views are the host views: there is nothing to copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self._arrays: list[npt.NDArray[np.generic]] = []

    def add(self, array: npt.ArrayLike, dtype: type) -> int:
        packed: npt.NDArray[np.generic] = np.ascontiguousarray(array, dtype=dtype)
        if packed.dtype not in _TORCH_DTYPES:
            raise TypeError(f"cannot stage {packed.dtype}: use int64, int32 or float32")
        self._arrays.append(packed)
        return len(self._arrays) - 1

    def send(self) -> Staged:
        """Pack every added array into one buffer and start its copy on the current stream.

        The host views on CUDA are the added arrays themselves (the host reads them; only the copy needs
        pinned memory); the device views come from one split of the device buffer."""
        sizes: list[int] = []  # each array's bytes, then its padding to the next boundary
        for array in self._arrays:
            padded = -(-array.nbytes // _ALIGN) * _ALIGN
            sizes += [array.nbytes, padded - array.nbytes]
        total = sum(sizes)
        buffer = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=self.pin)
        raw = buffer.numpy()
        offset = 0
        for array, size, pad in zip(self._arrays, sizes[::2], sizes[1::2]):
            raw[offset : offset + size] = array.reshape(-1).view(np.uint8)
            offset += size + pad
        on_device = buffer.to(self.device, non_blocking=True) if self.pin else buffer
        chunks = on_device[:total].split(sizes)[::2]
        device = [_typed(chunk, array) for chunk, array in zip(chunks, self._arrays)]
        host = [torch.from_numpy(array) for array in self._arrays] if self.pin else device
        return Staged(host, device)


def _typed(chunk: torch.Tensor, array: npt.NDArray[np.generic]) -> torch.Tensor:
    """The bytes of `chunk` as `array`'s dtype and shape (a 1-D view needs no reshape)."""
    typed = chunk.view(_TORCH_DTYPES[array.dtype])
    return typed if array.ndim == 1 else typed.view(array.shape)
