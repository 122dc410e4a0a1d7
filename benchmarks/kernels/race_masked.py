"""The one-pass sampling race with and without structured-output masks, on the device alone.

A mixed batch (some rows under a JSON schema) samples every row in one masked launch, so whatever the
masks add to that launch lengthens the step of the plain rows beside them too. This times, per batch
size, the race over a [rows, 151,936] bf16 head: plain; masked with every other row constrained; and the
masked launch over the constrained rows alone (what the plain rows would not share if the two were split).
Also the masks' host-to-device copy for 128 rows. CUDA graphs of back-to-back calls over distinct inputs,
µs per call.

    python benchmarks/kernels/race_masked.py          # on the GPU: results/race-masked-h200.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks.common import RESULTS, graph_us, write_result
from tandem.engine.sampler import race_keys
from tandem.engine.sampling_race import race_sample

VOCAB = 151_936
CALLS = 8


def race_row(rows: int, vocab: int, columns: torch.Tensor) -> dict[str, Any]:
    device = columns.device
    g = torch.Generator(device=device).manual_seed(rows)
    logits = [
        (torch.randn(rows, vocab, device=device, generator=g) * 3).to(torch.bfloat16) for _ in range(CALLS)
    ]
    temperature = torch.full((rows,), 0.6, device=device)
    seeds = torch.arange(rows, device=device, dtype=torch.int64)
    steps = torch.zeros(rows, device=device, dtype=torch.int64)
    constrained = torch.arange(1, rows, 2, device=device)
    words = -(-vocab // 32)
    masks = torch.randint(-(2**31), 2**31 - 1, (len(constrained), words), device=device, dtype=torch.int32)
    sub = [x[constrained] for x in logits]
    own_rows = torch.arange(len(constrained), device=device)
    sub_args = (temperature[constrained], seeds[constrained], steps[constrained], columns)

    def plain(i: int) -> torch.Tensor:
        return race_sample(logits[i], temperature, seeds, steps, columns, vocab_size=vocab)

    def masked(i: int) -> torch.Tensor:
        return race_sample(
            logits[i], temperature, seeds, steps, columns,
            vocab_size=vocab, bitmask=masks, bitmask_rows=constrained, bitmask_vocab=vocab,
        )  # fmt: skip

    def constrained_only(i: int) -> torch.Tensor:
        return race_sample(
            sub[i], *sub_args, vocab_size=vocab, bitmask=masks, bitmask_rows=own_rows, bitmask_vocab=vocab
        )

    row: dict[str, Any] = {"rows": rows, "constrained": len(constrained)}
    for name, call in (("plain_us", plain), ("masked_us", masked), ("constrained_only_us", constrained_only)):
        row[name] = round(graph_us(call, CALLS), 2)
    return row


def upload_us(rows: int, vocab: int, device: torch.device) -> float:
    host = torch.empty((rows, -(-vocab // 32)), dtype=torch.int32, pin_memory=True)
    on_device = torch.empty(host.shape, dtype=host.dtype, device=device)
    for _ in range(3):
        on_device.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        on_device.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / 20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="8,16,64,128,224,256")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device("cuda")
    columns = race_keys(VOCAB, device)
    rows = [race_row(int(b), VOCAB, columns) for b in args.batches.split(",")]
    payload = {
        "config": {"vocab": VOCAB, "logits": "bf16", "temperature": 0.6, "constrained": "every other row"},
        "rows": rows,
        "mask_upload_us_128_rows": round(upload_us(128, VOCAB, device), 2),
    }
    path = write_result(f"race-masked-{args.tag}", payload, device=device, out_dir=args.out_dir)
    print(path)
    for row in rows:
        print(row)
    print("mask upload, 128 rows:", payload["mask_upload_us_128_rows"], "µs")


if __name__ == "__main__":
    main()
