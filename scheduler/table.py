"""Request slots, the device token pool and the host page tables.

The token pool holds every request's token ids on the device (prompt, then outputs as they are
sampled), so the next step's input ids are gathered there and the GPU never waits for the host to
learn a token. Its last element is a trash slot: writes for rows that produce no token use index -1.
"""

from __future__ import annotations

import numpy as np
import torch


class RequestTable:
    """`max_running` rows of `max_seq_len` tokens. Slots are handed out lowest first (deterministic)."""

    def __init__(
        self, max_running: int, max_seq_len: int, page_size: int, num_groups: int, device: torch.device
    ) -> None:
        self.max_running = max_running
        self.max_seq_len = max_seq_len
        self.device = device
        # One spare entry past the rows: where a batch row with no token to keep writes its sample.
        self.token_pool = torch.zeros(max_running * max_seq_len + 1, dtype=torch.int64, device=device)
        self.spare = max_running * max_seq_len
        max_pages = -(-max_seq_len // page_size)
        # Host tables are numpy: building a batch does many tiny gathers, and torch's intra-op thread
        # pool costs milliseconds per tiny op on a busy host, where numpy costs microseconds.
        self.page_tables = [np.zeros((max_running, max_pages), dtype=np.int32) for _ in range(num_groups)]
        self._free = list(range(max_running - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)

    def flat_index(self, slot: int, position: int) -> int:
        return slot * self.max_seq_len + position

    def write_prompt(self, slot: int, token_ids: list[int], pin: bool) -> None:
        """Copy a prompt into the pool (the caller runs this on the scheduler stream)."""
        host = torch.tensor(token_ids, dtype=torch.int64, pin_memory=pin)
        start = slot * self.max_seq_len
        self.token_pool[start : start + len(token_ids)].copy_(host, non_blocking=True)

    def set_pages(self, group: int, slot: int, first: int, pages: list[int]) -> None:
        if pages:
            self.page_tables[group][slot, first : first + len(pages)] = pages
