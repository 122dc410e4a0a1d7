"""Tensor-parallel replicas on a local Ray cluster (CPU, gloo)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.replicas.llm_replica import LLMReplica
from tandem.scheduler.sampling_params import StructuredOutputs

MAX_NEW = 16


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def prompts_for(model_dir: Path, n: int = 4) -> list[list[int]]:
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (4, 19, 37, 8)[:n]]


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


async def collect(replica: LLMReplica, prompt: list[int], sp: SamplingParams) -> dict[str, Any]:
    tokens: list[int] = []
    finish = error = None
    async for chunk in replica.generate(prompt, sp):
        tokens += chunk.token_ids
        finish, error = chunk.finish_reason, chunk.error
    return {"tokens": tokens, "finish": finish, "error": error}


async def settled_samples(replica: LLMReplica, timeout_s: float = 10.0) -> list[list[tuple[int, int]]]:
    """Each rank's sampled (request, token) pairs, once every rank has processed as many steps: the
    streams end when rank 0 has processed the last step, and another rank may still be one step behind."""
    deadline = time.monotonic() + timeout_s
    per_rank = await replica.sampled_tokens()
    while len({len(tokens) for tokens in per_rank}) > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        per_rank = await replica.sampled_tokens()
    return per_rank


def replica(model_dir: Path, tp: int, **engine: Any) -> LLMReplica:
    return LLMReplica(str(model_dir), tp_size=tp, device="cpu", engine={"page_size": 4, **engine})


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_tp2_replica_and_llm_match_tp1_and_hf(ray_cluster: None, tiny_model_dir, family: str) -> None:
    model_dir = tiny_model_dir(family)
    prompts = prompts_for(model_dir)
    ref = hf_greedy(model_dir, prompts)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)

    async def run() -> list[list[int]]:
        rep = replica(model_dir, 2)
        try:
            outs = await asyncio.gather(*(collect(rep, p, greedy) for p in prompts))
            return [o["tokens"] for o in outs]
        finally:
            await rep.shutdown(drain_timeout_s=1)

    assert asyncio.run(run()) == ref
    llm2 = LLM(str(model_dir), tp_size=2, device="cpu")
    try:
        assert [o.token_ids for o in llm2.generate(prompts, greedy, use_tqdm=False)] == ref
    finally:
        llm2.shutdown()
    llm1 = LLM(str(model_dir), device="cpu")
    assert [o.token_ids for o in llm1.generate(prompts, greedy, use_tqdm=False)] == ref


def test_seeded_sampling_agrees_across_ranks_and_abort_frees_kv(ray_cluster: None, tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    prompts = prompts_for(model_dir)

    async def run() -> None:
        rep = replica(model_dir, 2)
        await rep.start()
        try:
            sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=21)
            outs = await asyncio.gather(*(collect(rep, p, sp) for p in prompts))
            assert all(o["finish"] in ("stop", "length") for o in outs)
            per_rank = await settled_samples(rep)
            assert per_rank[0] == per_rank[1] and len(per_rank[0]) >= len(prompts)
            # Structured outputs: each rank masks with its own matchers, so they must agree too.
            regex = SamplingParams(
                max_tokens=8, seed=5, structured_outputs=StructuredOutputs(regex="[0-9]{3}")
            )
            constrained = await asyncio.gather(*(collect(rep, p, regex) for p in prompts))
            texts = [rep.tokenizer.decode(o["tokens"], skip_special_tokens=True) for o in constrained]
            assert all(len(t) == 3 and t.isdigit() for t in texts), texts
            per_rank = await settled_samples(rep)
            assert per_rank[0] == per_rank[1]
            # Abort long requests mid-flight by dropping their consumers.
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

            async def first_chunks(p: list[int]) -> None:
                gen = rep.generate(p, long)
                async for _ in gen:
                    break
                await gen.aclose()

            await asyncio.gather(*(first_chunks(p) for p in prompts))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                stats = await rep.rank_stats()
                if all(s["kv_pages_used"] == 0 and s["num_running"] == 0 for s in stats):
                    break
                await asyncio.sleep(0.1)
            assert all(s["kv_pages_used"] == 0 and s["num_running"] == 0 for s in stats), stats
        finally:
            await rep.shutdown(drain_timeout_s=1)

    asyncio.run(run())


def test_killing_a_rank_fails_requests_fast_and_a_new_replica_serves(
    ray_cluster: None, tiny_model_dir
) -> None:
    model_dir = tiny_model_dir("qwen2")
    prompts = prompts_for(model_dir) * 2  # 8 concurrent generations
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        rep = replica(model_dir, 2)
        await rep.start()
        try:
            tasks = [asyncio.create_task(collect(rep, p, long)) for p in prompts]
            await asyncio.sleep(1.0)
            assert rep._group is not None
            killed_at = time.monotonic()
            ray.kill(rep._group.actors[1])
            outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
            assert time.monotonic() - killed_at < 10
            assert all(o["finish"] == "error" and o["error"] for o in outs), outs
            with pytest.raises(RuntimeError, match="rank 1"):
                await rep.check_health()
        finally:
            await rep.shutdown(drain_timeout_s=0)
        fresh = replica(model_dir, 2)
        try:
            greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
            out = await collect(fresh, prompts[0], greedy)
            assert out["tokens"] == hf_greedy(model_dir, prompts[:1])[0]
            await fresh.check_health()
        finally:
            await fresh.shutdown(drain_timeout_s=1)

    asyncio.run(run())


def test_unplaceable_group_fails_clearly(ray_cluster: None, tiny_model_dir) -> None:
    from tandem.replicas.rank_group import RankGroup

    group = RankGroup(2, use_gpu=False, cpus_per_rank=5.0, timeout_s=3.0)  # 10 CPUs on an 8-CPU cluster
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not place 2 rank bundle\(s\).*CPU"):
        group._placement_group()
    assert time.monotonic() - start < 30
