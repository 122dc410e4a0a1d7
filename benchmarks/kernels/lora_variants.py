"""The LoRA delta at one token (the batch-1 decode graph) on the Llama-3.1-8B shape, in the ways its two
launches (engine/lora/triton_lora.py) can run, against the same chain without LoRA.

Each layer is its four linear layers as the batch-1 graph runs them: the Triton GEMV for the base weight,
then the rank-16 delta of the row's slot (q/k/v, o, gate/up, down), every kernel launched with PDL, each
layer's input the output before it. 32 layers with their own weights are captured in one CUDA graph, and
`us_per_layer` is a replay over 32. Rows:

- `base`: the GEMVs alone;
- `lora`, with the shrink's `stretch` (input features a program, so the expand sums K / stretch partials)
  and `fold` (the expand inside the GEMV's epilogue: one launch fewer a linear layer);
- `shrink_only`: the engine's shrink without its expand (wrong output: what an expand folded into the
  GEMV could at best save).

Every LoRA variant is checked against the two-launch form first.

    python benchmarks/kernels/lora_variants.py --out /tmp/lora-variants.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.benchmarks.common import device_info, git_commit, graph_us, print_table
from tandem.engine.kernel_plan import KernelPlan
from tandem.engine.layers.triton_gemv import gemv
from tandem.engine.lora.batch import LoraBatchBuffers
from tandem.engine.lora.delta import LoraContext, LoraDelta
from tandem.engine.lora.layout import LinearLayout, LoraSlice
from tandem.engine.lora.triton_lora import LoraLaunch, TritonLoraOps

HIDDEN, INTER, Q, KV, LAYERS, RANK, SLOTS = 4096, 14336, 4096, 1024, 32, 16, 8
# (input features, output slices) of each linear layer of a Llama layer, in order.
LINEARS = [(HIDDEN, (Q, KV, KV)), (Q, (HIDDEN,)), (HIDDEN, (INTER, INTER)), (INTER, (HIDDEN,))]
PLAN = KernelPlan(rows=1, pdl=True, gemv=True, lora=True, lora_pdl=True)
VARIANTS = [LoraLaunch(stretch, fold) for fold in (False, True) for stretch in (256, 512, 1024)]


class Chain:
    """LAYERS layers of base weights and one slot's deltas, on one token of slot 0."""

    def __init__(self) -> None:
        device = torch.device("cuda")
        g = torch.Generator(device=device).manual_seed(0)
        self.buffers = LoraBatchBuffers(16, SLOTS, device)
        self.buffers.write(np.array([0], dtype=np.int32), np.array([1], dtype=np.int32))
        self.context = LoraContext(self.buffers)
        self.layers: list[list[tuple[torch.Tensor, LoraDelta]]] = []
        for _ in range(LAYERS):
            linears = []
            for k, widths in LINEARS:
                n = sum(widths)
                w = (torch.randn(n, k, generator=g, device=device) / k**0.5).bfloat16()
                offsets = [sum(widths[:i]) for i in range(len(widths))]
                pieces = tuple(LoraSlice(f"p{i}", o, s, 0) for i, (o, s) in enumerate(zip(offsets, widths)))
                layout = LinearLayout(0, len(widths) == 1, pieces, k, 0, n, RANK, 0, 0)
                a = (torch.randn(SLOTS, layout.a_rows, k, generator=g, device=device) / k**0.5).bfloat16()
                b = (torch.randn(SLOTS, n, RANK, generator=g, device=device) / RANK**0.5).bfloat16()
                linears.append((w, LoraDelta(a, b, layout, self.context, TritonLoraOps())))
            self.layers.append(linears)
        self.x = torch.randn(1, HIDDEN, generator=g, device=device).bfloat16()

    def layer(self, i: int, ops: TritonLoraOps | None, expand: bool = True) -> torch.Tensor:
        h = self.x
        for w, delta in self.layers[i]:
            x = h[:, : w.shape[1]]
            folded = ops.fold(x, delta, PLAN) if ops is not None else None
            h = gemv(x, w, pdl=True, delta=folded)
            if ops is not None and folded is None:
                partial = ops.shrink(x, delta, PLAN)
                if expand:
                    ops.expand(partial, h, delta, PLAN)
        return h

    def us(self, ops: TritonLoraOps | None, expand: bool = True) -> float:
        return graph_us(lambda i: self.layer(i, ops, expand), LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    chain = Chain()
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        want = chain.layer(0, TritonLoraOps(LoraLaunch(fold=False))).float()
        base_us = chain.us(None)
        rows.append({"variant": "base", "us_per_layer": base_us, "over_base_us": 0.0})
        for launch in VARIANTS:
            ops = TritonLoraOps(launch)
            got = chain.layer(0, ops).float()
            err = float((got - want).abs().max() / want.abs().max())
            us = chain.us(ops) if err < 1e-2 else float("inf")
            rows.append({"variant": "lora", "stretch": launch.stretch, "fold": launch.fold,
                         "us_per_layer": us, "over_base_us": us - base_us, "rel_err": err})  # fmt: skip
        us = chain.us(TritonLoraOps(LoraLaunch(fold=False)), expand=False)
        rows.append({"variant": "shrink_only", "us_per_layer": us, "over_base_us": us - base_us})
    device = torch.device("cuda")
    config = {"shape": "Llama-3.1-8B linear layers", "layers": LAYERS, "rank": RANK, "slots": SLOTS,
              "tokens": 1, "plan": str(PLAN)}  # fmt: skip
    record = {"device": device_info(device), "commit": git_commit(), "config": config, "rows": rows}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    columns = ["variant", "stretch", "fold", "us_per_layer", "over_base_us", "rel_err"]
    print_table(rows, columns)


if __name__ == "__main__":
    main()
