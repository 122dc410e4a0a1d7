"""The MoE layer's one- and two-token path (engine/moe/triton_small.py) at Qwen3-30B-A3B's layer shape
(128 experts, top 8, hidden 2048, expert intermediate 768, bf16), in its launch plans and block shapes:

- `routed`: one program a token routes first (choose_kernel) and every up and down program reads its
  experts, against every program routing for itself from the logits;
- `pdl`: the three (or two) kernels launched with programmatic dependent launch, as a small decode graph
  launches them, so each one's weight loads may be issued while the kernel before it drains;
- the up and down kernels' output features a program (BN), reduction block (BK) and warps.

Each variant is timed in a CUDA graph of 48 calls (a decode step's layers), each with its own token and so
its own experts, behind the router's GEMV as the layer runs it, so L2 serves few of the expert weights;
`bound_us` is the bytes a call must read (the router and its tokens' distinct experts) at the copy
bandwidth measured in the same run. Every variant is checked against the float32 reference first.

    python benchmarks/kernels/moe_small_variants.py --out /tmp/moe-small.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import device_info, git_commit, graph_us, measure_ceilings, print_table
from tandem.engine.layers.triton_gemv import gemv
from tandem.engine.moe.fused import SMALL_BLOCKS, FusedMoE, SmallBlocks
from tandem.engine.moe.reference import reference_choice, reference_experts
from tandem.engine.moe.spec import ExpertShard, MoESpec

E, K, H, INTER, LAYERS = 128, 8, 2048, 768, 48
UP_SHAPES = list(itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8)))  # BN, BK, warps
DOWN_SHAPES = list(itertools.product((2, 4, 8, 16), (256, 512, 1024), (2, 4, 8)))


class Case:
    """One layer's weights and LAYERS calls' tokens on the GPU, with the reference output of call 0."""

    def __init__(self, tokens: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(tokens)
        self.w13 = (torch.randn(E, 2 * INTER, H, generator=g, device="cuda") / H**0.5).bfloat16()
        self.w2 = (torch.randn(E, H, INTER, generator=g, device="cuda") / INTER**0.5).bfloat16()
        self.router = (torch.randn(E, H, generator=g, device="cuda") / H**0.5).bfloat16()
        self.xs = torch.randn(LAYERS, tokens, H, generator=g, device="cuda").bfloat16()
        spec = MoESpec(E, K, INTER, True, (True,))
        self.fused = FusedMoE(spec, ExpertShard.of(spec, 0, 1, expert_parallel=False), H)
        logits = gemv(self.xs[0], self.router)
        weights, ids = reference_choice(logits.cpu(), K, renormalize=True)
        self.want = reference_experts(self.xs[0], weights, ids, self.w13, self.w2)
        per_call = [len(set(torch.topk(gemv(x, self.router).float(), K).indices.flatten().tolist()))
                    for x in self.xs]  # fmt: skip
        self.bytes = (E * H + sum(per_call) / LAYERS * 3 * INTER * H) * 2

    def layer(self, i: int, blocks: SmallBlocks, pdl: bool) -> torch.Tensor:
        x = self.xs[i]
        logits = gemv(x, self.router, pdl=pdl)
        out: torch.Tensor = self.fused._small(x, logits, self.w13, self.w2, None, None, pdl, blocks)
        return out

    def error(self, blocks: SmallBlocks, pdl: bool) -> float:
        got = self.layer(0, blocks, pdl).float()
        return float((got - self.want).pow(2).mean().sqrt() / self.want.pow(2).mean().sqrt())

    def time(self, blocks: SmallBlocks, pdl: bool) -> float:
        return graph_us(lambda i: self.layer(i, blocks, pdl), LAYERS)


def measure(case: Case, blocks: SmallBlocks, pdl: bool, bound_us: float) -> dict[str, Any]:
    err = case.error(blocks, pdl)
    us = case.time(blocks, pdl) if err < 1e-2 else float("inf")  # a wrong variant ranks last
    return {**dataclasses.asdict(blocks), "pdl": pdl, "us": us, "x_bound": us / bound_us, "rel_rms": err}


def sweep(case: Case, bound_us: float) -> list[dict[str, Any]]:
    """The launch plans at the engine's blocks, then each kernel's shapes in the fastest plan, one
    kernel at a time (the other at its best so far)."""
    rows = [measure(case, dataclasses.replace(SMALL_BLOCKS, routed=r), p, bound_us)
            for r in (False, True) for p in (False, True)]  # fmt: skip
    best = min(rows, key=lambda r: r["us"])
    plan = {"routed": best["routed"]}
    pdl = bool(best["pdl"])
    up_rows = [measure(case, dataclasses.replace(SMALL_BLOCKS, **plan, up_bn=n, up_bk=k, up_warps=w), pdl,
                       bound_us) for n, k, w in UP_SHAPES]  # fmt: skip
    up = min(up_rows, key=lambda r: r["us"])
    chosen = {"up_bn": up["up_bn"], "up_bk": up["up_bk"], "up_warps": up["up_warps"]}
    down_rows = [measure(case, dataclasses.replace(SMALL_BLOCKS, **plan, **chosen, down_bn=n, down_bk=k,
                                                   down_warps=w), pdl, bound_us)
                 for n, k, w in DOWN_SHAPES]  # fmt: skip
    return rows + up_rows + down_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    record: dict[str, Any] = {"device": device_info(device), "commit": git_commit(), "ceilings": ceilings}
    columns = ["routed", "pdl", "up_bn", "up_bk", "up_warps", "down_bn", "down_bk", "down_warps", "us",
               "x_bound", "rel_rms"]  # fmt: skip
    summary = []
    with torch.inference_mode():
        for tokens in args.tokens:
            case = Case(tokens)
            bound_us = case.bytes / (ceilings["copy_bandwidth_GBps"] * 1e9) * 1e6
            rows = sweep(case, bound_us)
            record[f"tokens_{tokens}"] = {"bound_us": bound_us, "rows": rows}
            ranked = sorted(rows, key=lambda r: r["us"])
            # The engine launches its blocks with PDL in a small decode graph.
            engine = next(r for r in rows[:4] if r["routed"] == SMALL_BLOCKS.routed and r["pdl"])
            print(f"\n{tokens} token(s): bound {bound_us:.1f} us; the launch plans first, then the best")
            print_table(rows[:4] + ranked[:5], columns)
            best = {c: ranked[0][c] for c in columns[:8]}
            summary.append({"tokens": tokens, "bound_us": bound_us, "engine_us": engine["us"],
                            "best_us": ranked[0]["us"], "best": best})  # fmt: skip
    record["summary"] = summary
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print()
    print_table(summary, ["tokens", "bound_us", "engine_us", "best_us", "best"])


if __name__ == "__main__":
    main()
