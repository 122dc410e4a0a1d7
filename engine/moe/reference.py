"""The plain reference every MoE path is tested against: the routed experts computed as HF transformers
computes them, one expert at a time over the tokens routed to it, in float32.

Not used when serving (it reads routing results back to the host); the CPU tests check the engine's torch
path against it, the interpreter tests and the GPU tests the Triton kernels. It runs where `x` is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_choice(
    logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tie rule written out, row by row in Python: decreasing probability, then the lower index."""
    probs = torch.softmax(logits.float(), dim=-1)
    ids = []
    for row in probs.tolist():
        ids.append(sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k])
    index = torch.tensor(ids, dtype=torch.int64).view(-1, top_k)
    weights = probs.gather(1, index)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


def reference_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    expert_start: int = 0,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t) over the chosen experts e = ids[t, j] that
    this shard holds (`w13` [E_local, 2I, H] with the gate rows first, `w2` [E_local, H, I]; experts
    [expert_start, expert_start + E_local)), in float32: [T, H]."""
    x32 = x.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(ids.to(x.device) == e + expert_start, as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = F.linear(x32[token], w13[e].float())
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[e].float()) * weights.to(x.device)[token, slot, None].float()
        out.index_add_(0, token, y)
    return out
