"""LoRA at tp_size=2 over gloo (two processes): each rank reads its shard of every adapter (B's rows of a
column layer's output shard, per slice of the merged q/k/v and gate/up; A's columns of a row layer's input
shard, summed by the layer's one all-reduce), and both ranks give HF's greedy tokens with the adapter
merged by PEFT, for two adapters and base requests in one batch, through one slot (loads and evictions on
both ranks alike)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.engine.distributed import TPGroup
from tandem.engine.tiny.adapters import write_random_adapter
from tandem.scheduler.messages import AddRequest, LoRARequest, SamplingSpec, TokenOutput
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions

from .lora_refs import merged_greedy, peft_adapter
from .rank_runs import run_until_idle

PROMPT_LENS = [6, 21, 13]
MAX_NEW = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank(model_dir: str, rank: int, size: int, port: int, requests: list[AddRequest]) -> dict[str, Any]:
    tp = TPGroup()
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        tp = TPGroup(rank, size, dist.group.WORLD)
    outputs: list[TokenOutput] = []
    options = RuntimeOptions.of(device="cpu", enable_lora=True, max_loras=1, max_running=3)
    runtime = RankRuntime(Path(model_dir), options, tp, outputs.extend)
    done = run_until_idle(runtime, outputs, list(requests))
    tokens = {r.rid: done.get(r.rid, []) for r in requests}
    stats = runtime.scheduler.stats()
    if size > 1:
        dist.destroy_process_group()
    return {"tokens": tokens, "loads": stats["lora_loads"], "evictions": stats["lora_evictions"]}


def _worker(rank: int, model_dir: str, port: int, requests: list[AddRequest], queue: Any) -> None:
    torch.set_num_threads(1)
    queue.put((rank, run_rank(model_dir, rank, 2, port, requests)))


def test_tp2_lora_matches_merged_hf(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen2")
    adapters = [
        peft_adapter(model_dir, tmp_path / "a", seed=4, r=8, lora_alpha=16, target_modules="all-linear"),
        write_random_adapter(tmp_path / "b", model_dir, rank=4, alpha=4, seed=5),
    ]
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    cases: list[Path | None] = [adapters[0], None, adapters[1]]
    requests = []
    for prompt in prompts:
        for j, adapter in enumerate(cases):
            lora = None if adapter is None else LoRARequest(adapter.name, j + 1, str(adapter))
            spec = SamplingSpec(max_tokens=MAX_NEW, temperature=0.0)
            requests.append(AddRequest(len(requests), prompt, spec, lora))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, str(model_dir), port, requests, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1], "TP ranks disagree"
    refs = {a: merged_greedy(model_dir, a, prompts, MAX_NEW) for a in cases}
    for request in requests:
        adapter = cases[request.rid % len(cases)]
        assert results[0]["tokens"][request.rid] == refs[adapter][request.rid // len(cases)], request.rid
    assert results[0]["loads"] >= 2 and results[0]["evictions"] >= 1
    assert refs[adapters[0]] != refs[None] and refs[adapters[1]] != refs[None]  # the adapters matter
