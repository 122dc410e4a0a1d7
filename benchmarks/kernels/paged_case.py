"""A paged KV layout for kernel timings (kernel_choices.py and its parts): rows over disjoint random pages."""

from __future__ import annotations

import torch

PAGE = 16
HEAD_DIM = 128
BF16 = torch.bfloat16


class PagedCase:
    """bs rows over disjoint random pages, one K/V cache per layer: ctx tokens each, or `lens[b]` tokens in
    row b (the lengths of an offline run's decode batch vary from 100 to 2,000)."""

    def __init__(self, kv_heads: int, bs: int, ctx: int, layers: int, lens: list[int] | None = None) -> None:
        self.lens = lens or [ctx] * bs
        per_row = torch.tensor([-(-n // PAGE) for n in self.lens], dtype=torch.int32)
        self.bs, self.ctx, self.kv_heads, self.layers = bs, max(self.lens), kv_heads, layers
        self.num_pages = int(per_row.sum())
        shape = (self.num_pages + 1, PAGE, kv_heads, HEAD_DIM)
        self.caches = [
            (torch.randn(shape, dtype=BF16, device="cuda"), torch.randn(shape, dtype=BF16, device="cuda"))
            for _ in range(layers)
        ]
        self.indptr_cpu = torch.cat((torch.zeros(1, dtype=torch.int32), per_row.cumsum(0).to(torch.int32)))
        self.indptr_cpu = self.indptr_cpu.pin_memory()
        self.indices = torch.randperm(self.num_pages, dtype=torch.int32, device="cuda")
        last = torch.tensor(self.lens, dtype=torch.int32) - (per_row - 1) * PAGE
        self.last_cpu = last.pin_memory()
        self.indptr = self.indptr_cpu.cuda()
        self.last = self.last_cpu.cuda()

    def kv_bytes(self) -> int:
        return sum(self.lens) * self.kv_heads * HEAD_DIM * 2 * 2
