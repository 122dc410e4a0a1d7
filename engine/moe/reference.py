"""The plain reference every MoE path is tested against: the routed experts computed as HF transformers
computes them, one expert at a time over the tokens routed to it, in float32.

Not used when serving (it reads routing results back to the host); the CPU tests check the engine's torch
path against it, the interpreter tests and the GPU tests the Triton kernels. It runs where `x` is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.moe.activation import gated
from tandem.engine.moe.spec import MoESpec, Scoring


def reference_choice(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, scoring: Scoring = "softmax_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tie rule written out, row by row in Python: decreasing probability, then the lower index.
    "topk_softmax": the same choice on the logits, then a softmax over the k chosen."""
    if scoring == "topk_softmax":
        rows = [sorted(range(len(r)), key=lambda e: (-r[e], e))[:top_k] for r in logits.float().tolist()]
        index = torch.tensor(rows, dtype=torch.int64).view(-1, top_k)
        return torch.softmax(logits.float().gather(1, index), dim=-1), index
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
    spec: MoESpec | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t) over the chosen experts e = ids[t, j] that
    this shard holds (`w13` [E_local, 2I, H] with the gate rows first, `w2` [E_local, H, I]; experts
    [expert_start, expert_start + E_local)), in float32: [T, H]. With `spec`, its activation; with `b13`
    [E_local, 2I] and `b2` [E_local, H], the experts' biases (each down bias weighted like its expert)."""
    x32 = x.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(ids.to(x.device) == e + expert_start, as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = F.linear(x32[token], w13[e].float(), None if b13 is None else b13[e].float())
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = F.silu(gate) * up if spec is None else gated(gate, up, spec)
        y = F.linear(act, w2[e].float(), None if b2 is None else b2[e].float())
        y = y * weights.to(x.device)[token, slot, None].float()
        out.index_add_(0, token, y)
    return out
