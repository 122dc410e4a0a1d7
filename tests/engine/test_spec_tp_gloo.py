"""Speculative decoding at TP 2 over gloo: both ranks draft, verify and accept alike, and the tokens are
HF's (greedy) and TP 1 without drafts' (seeded sampling); a request that turned speculation off rides in
the same batches as plain rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.engine.distributed import TPGroup
from tandem.engine.tiny import default_model_dir
from tandem.scheduler.messages import AddRequest, SamplingSpec, TokenOutput
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions

from .rank_runs import run_until_idle
from .test_tp_gloo import free_port

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# The demo model drafting for itself: every draft accepted, at TP 2 the draft engine is sharded too.
DRAFT = {"method": "draft_model", "model": str(default_model_dir()), "num_speculative_tokens": 3}


def _run(
    model_dir: str, rank: int, size: int, port: int, requests: list[AddRequest], spec: dict[str, Any] | None
) -> tuple[dict[int, list[int]], dict[str, Any]]:
    tp = TPGroup()
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        tp = TPGroup(rank, size, dist.group.WORLD)
    outputs: list[TokenOutput] = []
    options = RuntimeOptions.of(device="cpu", speculative_config=spec)
    runtime = RankRuntime(Path(model_dir), options, tp, outputs.extend)
    done = run_until_idle(runtime, outputs, list(requests))
    stats = {k: v for k, v in runtime.scheduler.stats().items() if k.startswith("spec_decode")}
    if size > 1:
        dist.destroy_process_group()
    return {r.rid: done.get(r.rid, []) for r in requests}, stats


def _worker(rank: int, model_dir: str, port: int, requests: list[AddRequest], spec, queue) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    queue.put((rank, _run(model_dir, rank, 2, port, requests, spec)))


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_tp2_with_drafts_matches_hf_and_tp1(spec: dict[str, Any]) -> None:
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    passage = tok((model_dir.parent / "corpus.txt").read_text()[:300])["input_ids"]
    prompts = [passage + passage[:12], passage[:30] + passage[:6], [5, 6, 7, 5, 6]]
    requests = [
        AddRequest(i, p, SamplingSpec(max_tokens=24, temperature=t, seed=50 + i, ignore_eos=t > 0))
        for i, (p, t) in enumerate(zip(prompts, [0.0, 0.9, 0.0], strict=True))
    ]
    prompts.append(passage[:40] + passage[:12])  # would draft, but turned speculation off
    requests.append(
        AddRequest(3, prompts[3], SamplingSpec(max_tokens=24, temperature=0.0, speculative=False))
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, str(model_dir), port, requests, spec, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (tokens0, stats0), (tokens1, stats1) = results[0], results[1]
    assert tokens0 == tokens1 and stats0 == stats1, "TP ranks disagree"
    assert stats0["spec_decode_num_accepted_tokens"] > stats0["spec_decode_num_drafts"] > 0
    if spec is DRAFT:
        assert stats0["spec_decode_num_accepted_tokens"] == stats0["spec_decode_num_draft_tokens"]
    plain, _ = _run(str(model_dir), 0, 1, 0, requests, None)
    assert tokens0 == plain
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    for i in (0, 2, 3):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompts[i]]), max_new_tokens=24, do_sample=False)[0]
        assert tokens0[i] == ref[len(prompts[i]) :].tolist()
