"""A paged KV layout for kernel timings (kernel_choices.py and its parts): rows over disjoint random pages."""

from __future__ import annotations

import torch

PAGE = 16
HEAD_DIM = 128
BF16 = torch.bfloat16


class PagedCase:
    """bs rows of ctx tokens each over disjoint random pages, one K/V cache per layer."""

    def __init__(self, kv_heads: int, bs: int, ctx: int, layers: int) -> None:
        per_row = -(-ctx // PAGE)
        self.bs, self.ctx, self.kv_heads, self.layers = bs, ctx, kv_heads, layers
        self.num_pages = bs * per_row
        shape = (self.num_pages + 1, PAGE, kv_heads, HEAD_DIM)
        self.caches = [
            (torch.randn(shape, dtype=BF16, device="cuda"), torch.randn(shape, dtype=BF16, device="cuda"))
            for _ in range(layers)
        ]
        self.indptr_cpu = (torch.arange(bs + 1, dtype=torch.int32) * per_row).pin_memory()
        self.indices = torch.randperm(self.num_pages, dtype=torch.int32, device="cuda")
        self.last_cpu = torch.full((bs,), ctx - (per_row - 1) * PAGE, dtype=torch.int32).pin_memory()
        self.indptr = self.indptr_cpu.cuda()
        self.last = self.last_cpu.cuda()

    def kv_bytes(self) -> int:
        return self.bs * self.ctx * self.kv_heads * HEAD_DIM * 2 * 2
