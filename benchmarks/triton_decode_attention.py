"""Paged decode attention in one Triton launch, split over the KV with the merge in the same launch: a
candidate for batch-1 decode, not yet measured on a GPU.

Why: at batch 1 and 512 tokens of context, flashinfer's decode (its tensor-core path, which the engine
runs) takes 10.4 µs a layer on an H200 for 2 MB of KV, about 1% of the copy bandwidth: it is latency,
not bytes (kernel-choices.json; no split, fixed splits and the CUDA-core kernel were no faster). Of
that, its split-KV merge is a second kernel of ~2.5 µs (decode-profile-llama-3.1-8b-32l.json). Here
program (row, KV head, split) attends its group of query heads over its share of the row's pages with
an online softmax in float32, writes its partial output and log-sum-exp, and takes a ticket; the
program that takes the last ticket of its (row, KV head) merges all the splits and resets the ticket,
so the merge costs no launch and the tickets are back at zero for the next replay of a CUDA graph.

Scores are a broadcast multiply and a sum over the head dim on CUDA cores: a group of 4 query heads is
too few rows for a tensor-core tile. No sliding window, soft-cap or prefix: the Llama-3.1-8B decode
case only. Checked against SDPA in Triton's CPU interpreter (tests/unit/test_triton_decode_attention.py),
where programs run one after another, so the interpreter checks the math, not the tickets' ordering.
`kernel_choices.py --parts attention` times it beside flashinfer's variants on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(  # type: ignore[no-untyped-def]  # pointers and constexprs
    q_ptr,
    k_ptr,
    v_ptr,
    indptr_ptr,
    indices_ptr,
    last_ptr,
    part_o_ptr,
    part_lse_ptr,
    tickets_ptr,
    out_ptr,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, PAGE)
    in_group = g < GROUP
    q = tl.load(q_ptr + (b * HQ + h * GROUP + g)[:, None] * D + d[None, :], mask=in_group[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    first = tl.load(indptr_ptr + b)
    pages = tl.load(indptr_ptr + b + 1) - first
    kv_len = (pages - 1) * PAGE + tl.load(last_ptr + b)
    per_split = tl.cdiv(pages, SPLITS)
    start = s * per_split
    end = tl.minimum(start + per_split, pages)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    for p in range(start, end):
        page = tl.load(indices_ptr + first + p).to(tl.int64)
        rows = (page * PAGE + t) * HKV + h  # [PAGE] rows of the [slots, HKV] cache views
        valid = p * PAGE + t < kv_len
        k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, PAGE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        probs = tl.exp(scores - m_new[:, None])
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        total = total * alpha + tl.sum(probs, axis=1)
        m = m_new
    # This split's normalised output and log-sum-exp; an empty split (a short row) weighs nothing.
    seen = total > 0
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    o = acc / tl.where(seen, total, 1.0)[:, None]
    base = (b * HKV + h) * SPLITS
    tl.store(part_o_ptr + ((base + s) * GROUP_PAD + g)[:, None] * D + d[None, :], o)
    tl.store(part_lse_ptr + (base + s) * GROUP_PAD + g, lse)
    # Release this split's partials, then take a ticket; the last taker reads them all back.
    ticket = tl.atomic_add(tickets_ptr + b * HKV + h, 1, sem="acq_rel")
    if ticket == SPLITS - 1:
        splits = tl.arange(0, SPLITS)
        lses = tl.load(part_lse_ptr + (base + splits)[:, None] * GROUP_PAD + g[None, :], cache_modifier=".cg")
        top = tl.max(lses, axis=0)  # [GROUP_PAD]; every row has a token, so some split saw one
        weights = tl.exp(lses - top[None, :])  # [SPLITS, GROUP_PAD]
        parts = tl.load(
            part_o_ptr
            + ((base + splits)[:, None, None] * GROUP_PAD + g[None, :, None]) * D
            + d[None, None, :],
            cache_modifier=".cg",
        )
        merged = tl.sum(weights[:, :, None] * parts, axis=0) / tl.sum(weights, axis=0)[:, None]
        out_rows = (b * HQ + h * GROUP + g)[:, None] * D + d[None, :]
        tl.store(out_ptr + out_rows, merged.to(out_ptr.dtype.element_ty), mask=in_group[:, None])
        tl.atomic_xchg(tickets_ptr + b * HKV + h, 0)  # ready for the next launch or graph replay


class TritonDecodeAttention:
    """The scratch space for up to `max_batch` rows: partial outputs, log-sum-exps and tickets, at
    fixed addresses so a CUDA graph can capture the launch."""

    def __init__(
        self, max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int, *, splits: int, device: Any
    ) -> None:
        if num_heads % num_kv_heads or splits & (splits - 1) or head_dim & (head_dim - 1):
            raise ValueError("needs whole query groups, and powers of two for the splits and head_dim")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.splits = head_dim, splits
        self.group = num_heads // num_kv_heads
        self.group_pad = triton.next_power_of_2(self.group)
        slots = max_batch * num_kv_heads * splits * self.group_pad
        self.part_o = torch.empty(slots, head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(slots, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)

    def __call__(
        self,
        q: torch.Tensor,
        paged_kv: tuple[torch.Tensor, torch.Tensor],
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, H, D] over caches [pages, page_size, Hkv, D] (flashinfer's NHD layout), rows listed
        as CSR pages (indptr [B + 1], indices, last_page_len [B]) -> [B, H, D]."""
        k_cache, v_cache = paged_kv
        batch, page = q.shape[0], k_cache.shape[1]
        if out is None:
            out = torch.empty_like(q)
        launch: Any = decode_attention_kernel[(batch, self.num_kv_heads, self.splits)]
        launch(
            q,
            k_cache,
            v_cache,
            indptr,
            indices,
            last_page_len,
            self.part_o,
            self.part_lse,
            self.tickets,
            out,
            scale,
            HQ=self.num_heads,
            HKV=self.num_kv_heads,
            D=self.head_dim,
            PAGE=page,
            GROUP=self.group,
            GROUP_PAD=self.group_pad,
            SPLITS=self.splits,
        )
        return out


def time_splits(
    row: dict[str, Any],
    case: Any,
    num_heads: int,
    q: torch.Tensor,
    reference: torch.Tensor | None,
    layers: int,
    splits: tuple[int, ...] = (4, 8, 16, 32),
) -> None:
    """kernel_choices.py's attention part: this kernel at each split count, as `triton-s{n}` (µs per
    layer from CUDA-graph replays over the case's per-layer caches) and its max error against
    flashinfer's output in `reference`."""
    import functools

    from tandem.benchmarks.common import graph_us

    scale = q.shape[-1] ** -0.5  # flashinfer's default sm_scale, as the other variants run
    for n in splits:
        name = f"triton-s{n}"
        try:
            attend = TritonDecodeAttention(
                case.bs, num_heads, case.kv_heads, q.shape[-1], splits=n, device=q.device
            )
            out = attend(q, case.caches[0], case.indptr, case.indices, case.last, scale)
            if reference is not None:
                row[f"{name}_err"] = round(float((out.float() - reference.float()).abs().max()), 4)
            run = functools.partial(_run, attend, q, case, scale, out)
            row[name] = round(graph_us(run, layers), 2)
        except Exception as exc:  # one variant's failure must not hide the others
            row[name] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"


def _run(
    attend: TritonDecodeAttention, q: torch.Tensor, case: Any, scale: float, out: torch.Tensor, i: int
) -> None:
    attend(q, case.caches[i], case.indptr, case.indices, case.last, scale, out=out)
