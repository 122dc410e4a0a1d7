"""TP=2 over gloo (two processes) gives the same tokens as TP=1."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.engine.distributed import TPGroup
from tandem.scheduler.messages import AddRequest, SamplingSpec, TokenOutput
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions

from .rank_runs import run_until_idle

PROMPT_LENS = [5, 17, 40, 9]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank(
    model_dir: str, rank: int, size: int, port: int, requests: list[AddRequest]
) -> dict[int, list[int]]:
    tp = TPGroup()
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        tp = TPGroup(rank, size, dist.group.WORLD)
    outputs: list[TokenOutput] = []
    runtime = RankRuntime(Path(model_dir), RuntimeOptions.of(device="cpu"), tp, outputs.extend)
    done = run_until_idle(runtime, outputs, list(requests))
    tokens = {r.rid: done.get(r.rid, []) for r in requests}
    if size > 1:
        dist.destroy_process_group()
    return tokens


def _worker(rank: int, model_dir: str, port: int, requests: list[AddRequest], queue) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    queue.put((rank, run_rank(model_dir, rank, 2, port, requests)))


def make_requests(vocab: int) -> list[AddRequest]:
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i, n in enumerate(PROMPT_LENS):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        # Half greedy, half seeded sampling: both ranks must draw the same tokens.
        temperature = 0.0 if i % 2 == 0 else 0.9
        reqs.append(AddRequest(i, ids, SamplingSpec(max_tokens=24, temperature=temperature, seed=100 + i)))
    return reqs


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "qwen3-fp8"])
def test_tp2_gloo_matches_tp1(family: str, tiny_model_dir, tmp_path: Path) -> None:
    """`qwen3-fp8`: a block-scaled FP8 checkpoint whose 24 x 24 scale blocks straddle the shard
    boundaries, so each rank must read the scales of exactly its own rows or columns."""
    if family.endswith("-fp8"):
        from tandem.engine.quant.fp8_export import write_fp8_checkpoint

        write_fp8_checkpoint(tiny_model_dir("qwen3"), tmp_path / "fp8", layout="block", block=(24, 24))
        model_dir = str(tmp_path / "fp8")
    else:
        model_dir = str(tiny_model_dir(family))
    import json

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    requests = make_requests(vocab)
    single = run_rank(model_dir, 0, 1, 0, requests)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, model_dir, port, requests, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1], "TP ranks disagree on sampled tokens"
    assert results[0] == single
    assert all(len(t) > 0 for t in single.values())


def _gather_worker(rank: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TPGroup(rank, 2, dist.group.WORLD)
    shard = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    out = torch.full((3, 6), -1.0)  # one row more than the batch, as a decode graph's shared buffer
    got = tp.all_gather_last_dim(shard, out=out[:2])
    queue.put((rank, got.tolist(), out.tolist(), tp.all_gather_last_dim(shard).tolist()))
    dist.destroy_process_group()


def test_all_gather_into_a_fixed_buffer_over_gloo() -> None:
    """The LM head's gather at TP 2 written into a caller's buffer (a decode graph's logits) is the plain
    gather's result, in rank order, and leaves the buffer's other rows alone."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want = [[0.0, 1.0, 2.0, 10.0, 11.0, 12.0], [3.0, 4.0, 5.0, 13.0, 14.0, 15.0]]
    for got, out, plain in results.values():
        assert got == want and plain == want
        assert out == [*want, [-1.0] * 6]
