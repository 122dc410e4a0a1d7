"""One host buffer and one host-to-device copy for all the arrays a batch sends to the device.

A decode batch carries about twenty small arrays (token-pool indices, positions, lengths, page tables,
sampling parameters). Pinning and copying each on its own costs tens of microseconds of host time
apiece, which at large batch is a visible share of the step; packed, it is one `cudaMemcpyAsync` from a
pinned buffer the builder keeps (`PinnedSlots`), so no step pays for a pinned allocation either. Views are
made only for the arrays a batch reads (`Staged`), since each costs host time too.
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


@dataclass
class _PinnedSlot:
    tensor: torch.Tensor  # uint8, pinned
    raw: npt.NDArray[np.uint8]  # the same memory
    copied: torch.cuda.Event | None  # recorded after the copy that last read it


class PinnedSlots:
    """Pinned upload buffers, used in turn. A buffer is written again only once the copy that last read
    it has run: with the overlap loop at most two batches are staged ahead of the device, so with four
    buffers that wait is over before it starts."""

    def __init__(self, count: int = 4) -> None:
        self._slots: list[_PinnedSlot | None] = [None] * count
        self._next = 0

    def take(self, nbytes: int) -> _PinnedSlot:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        if slot is not None and slot.copied is not None:
            slot.copied.synchronize()
        if slot is None or slot.tensor.numel() < nbytes:
            # Rounded up, so a batch slightly larger than the last does not reallocate.
            tensor = torch.empty(max(2 * nbytes, 4096), dtype=torch.uint8, pin_memory=True)
            slot = self._slots[i] = _PinnedSlot(tensor, tensor.numpy(), None)
        return slot


class Staged:
    """The added arrays as tensors, made on demand: `host(i)` (the array itself; a view of the packed
    buffer on CPU) and `device(i)` (a view of the packed buffer's device copy)."""

    def __init__(
        self,
        arrays: list[npt.NDArray[np.generic]],
        offsets: list[int],
        packed: torch.Tensor,
        on_device: bool,
    ) -> None:
        self._arrays = arrays
        self._offsets = offsets
        self._packed = packed
        self._on_device = on_device

    def device(self, i: int) -> torch.Tensor:
        array, start = self._arrays[i], self._offsets[i]
        typed = self._packed[start : start + array.nbytes].view(_TORCH_DTYPES[array.dtype])
        return typed if array.ndim == 1 else typed.view(array.shape)

    def host(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self._arrays[i]) if self._on_device else self.device(i)


class Staging:
    """Collects arrays with `add` (which returns the array's index), then packs and sends them.

    On CPU the device views are the host views: there is nothing to copy. `slots` (CUDA): the pinned
    buffers to pack into; without them each send allocates one.
    """

    def __init__(self, device: torch.device, slots: PinnedSlots | None = None) -> None:
        self.device = device
        self.on_device = device.type == "cuda"
        self.slots = slots
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
        pinned memory)."""
        offsets: list[int] = []
        total = 0
        for array in self._arrays:
            offsets.append(total)
            total += -(-array.nbytes // _ALIGN) * _ALIGN
        total = max(total, _ALIGN)
        slot = None
        if self.slots is not None and self.on_device:
            slot = self.slots.take(total)
            host, raw = slot.tensor[:total], slot.raw
        else:
            host = torch.empty(total, dtype=torch.uint8, pin_memory=self.on_device)
            raw = host.numpy()
        for array, offset in zip(self._arrays, offsets):
            raw[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        if not self.on_device:
            return Staged(self._arrays, offsets, host, on_device=False)
        packed = torch.empty(total, dtype=torch.uint8, device=self.device)
        packed.copy_(host, non_blocking=True)
        if slot is not None:
            if slot.copied is None:
                slot.copied = torch.cuda.Event()
            slot.copied.record()
        return Staged(self._arrays, offsets, packed, on_device=True)
