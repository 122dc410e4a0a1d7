"""Hidden-state drafters at TP 2 over gloo: an EAGLE-3 head (its layer and its draft-vocabulary head
sharded like the target's) and DeepSeek-V3's MTP layer draft alike on both ranks, and the tokens are
HF's greedy tokens; a head that agrees with its target has every draft accepted at TP 2 too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.engine.distributed import TPGroup
from tandem.scheduler.messages import AddRequest, SamplingSpec, TokenOutput
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions

from .moe_ranks import free_port
from .rank_runs import run_until_idle
from .spec_heads import repeating, with_mtp_layer, write_eagle3
from .test_moe_models import hf_greedy, prompts_for

MAX_NEW = 16  # hf_greedy's
# name -> (target dir, speculative_config)
Jobs = dict[str, tuple[str, dict[str, Any]]]


def _worker(rank: int, port: int, jobs: Jobs, prompts: list[list[int]], queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TPGroup(rank, 2, dist.group.WORLD)
    results = {}
    spec = SamplingSpec(max_tokens=MAX_NEW, temperature=0.0)
    for name, (model_dir, config) in jobs.items():
        outputs: list[TokenOutput] = []
        options = RuntimeOptions.of(device="cpu", chunk_size=16, speculative_config=config)
        runtime = RankRuntime(Path(model_dir), options, tp, outputs.extend)
        done = run_until_idle(runtime, outputs, [AddRequest(i, p, spec) for i, p in enumerate(prompts)])
        stats = {k: v for k, v in runtime.scheduler.stats().items() if k.startswith("spec_decode")}
        results[name] = ([done.get(i, []) for i in range(len(prompts))], stats)
    dist.destroy_process_group()
    queue.put((rank, results))


def test_tp2_hidden_state_drafters_match_hf(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prompts = prompts_for(512)
    llama = tiny_model_dir("llama")
    rep = repeating(llama, tmp_path / "repeating")
    v3 = with_mtp_layer(tiny_model_dir("deepseek_v3"), tmp_path / "mtp")
    last = [p[-1] for p in prompts]
    random_head = write_eagle3(tmp_path / "random", llama, draft_vocab=200, keep=[])
    agree_head = write_eagle3(tmp_path / "agree", rep, draft_vocab=100, keep=last, agree=True)
    jobs: Jobs = {
        "eagle3": (str(llama), {"method": "eagle3", "model": str(random_head), "num_speculative_tokens": 3}),
        "agree": (str(rep), {"method": "eagle3", "model": str(agree_head), "num_speculative_tokens": 3}),
        "mtp": (str(v3), {"method": "mtp", "num_speculative_tokens": 2}),
    }
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, jobs, prompts, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1], "TP ranks disagree"
    targets = {"eagle3": llama, "agree": rep, "mtp": v3}
    want = {name: hf_greedy(model_dir, prompts) for name, model_dir in targets.items()}
    for name, (tokens, stats) in results[0].items():
        assert tokens == want[name], name
        assert stats["spec_decode_num_draft_tokens"] > 0, name
    agreed = results[0]["agree"][1]
    assert agreed["spec_decode_num_accepted_tokens"] == agreed["spec_decode_num_draft_tokens"]
