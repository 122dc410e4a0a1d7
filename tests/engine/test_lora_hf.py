"""LoRA adapters give HF transformers' greedy tokens with the adapter merged into the weights by PEFT
(`merge_and_unload`), on tiny models of two families (CPU, float32): three adapters (two saved by PEFT
itself, one by `write_random_adapter`; all seven projections, q/v alone with rsLoRA and per-module rank
and alpha patterns, the MLP alone at another rank) mixed in one batch with base requests, and the same
across slot loads, evictions and host-cache re-reads when the slots are fewer than the adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.engine.tiny.adapters import write_random_adapter

from .lora_refs import merged_greedy, peft_adapter

PROMPT_LENS = [5, 19, 40, 11]
MAX_NEW = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(
    request: pytest.FixtureRequest, tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    model_dir = tiny_model_dir(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = [
        peft_adapter(model_dir, root / "all", seed=1, r=8, lora_alpha=16, target_modules=ALL),
        peft_adapter(
            model_dir,
            root / "qv",
            seed=2,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
            rank_pattern={"v_proj": 6},
            alpha_pattern={"layers.1.self_attn.q_proj": 20},
        ),
        write_random_adapter(
            root / "mlp", model_dir, rank=16, alpha=32, targets=["gate_proj", "up_proj", "down_proj"], seed=3
        ),
    ]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs = {None: merged_greedy(model_dir, None, prompts, MAX_NEW)}
    for path in adapters:
        refs[path] = merged_greedy(model_dir, path, prompts, MAX_NEW)
    return {"model_dir": model_dir, "adapters": adapters, "prompts": prompts, "refs": refs}


def run_mixed(
    llm: LLM, case: dict[str, Any], adapters: list[Path | None]
) -> dict[Path | None, list[list[int]]]:
    """Every prompt under every adapter (and the base), all in one generate call, interleaved."""
    jobs = [(a, i) for i in range(len(case["prompts"])) for a in adapters]
    loras = [
        None if a is None else LoRARequest(a.name, 1 + case["adapters"].index(a), str(a)) for a, _ in jobs
    ]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outs = llm.generate([case["prompts"][i] for _, i in jobs], sp, lora_request=loras, use_tqdm=False)
    got: dict[Path | None, list[list[int]]] = {a: [[] for _ in case["prompts"]] for a in adapters}
    for (a, i), out in zip(jobs, outs):
        got[a][i] = out.token_ids
    return got


def test_adapters_mixed_with_base_rows_match_merged_hf(case: dict[str, Any]) -> None:
    llm = LLM(str(case["model_dir"]), device="cpu", enable_lora=True, max_loras=3)
    adapters: list[Path | None] = [None, *case["adapters"]]
    got = run_mixed(llm, case, adapters)
    refs = case["refs"]
    for a in adapters:
        assert got[a] == refs[a], a
    # Each adapter changes the output: a delta that was dropped would show here.
    for a in case["adapters"]:
        assert refs[a] != refs[None], a
    stats = llm.stats()
    assert stats["lora_loads"] == 3 and stats["lora_evictions"] == 0
    assert stats["kv_pages_used"] == 0
    # The prefix cache keeps each adapter's KV apart: a repeat of the same prompts, base then adapters,
    # gives the same tokens again.
    assert run_mixed(llm, case, adapters) == got
    llm.shutdown()


@pytest.mark.parametrize("count", [2, 3])
def test_fewer_slots_than_adapters_evict_and_reload(case: dict[str, Any], count: int) -> None:
    """One slot and a one-adapter host cache for two or three adapters in flight: requests wait for the
    slot, adapters are evicted and read again from disk, and every output is still exact."""
    llm = LLM(
        str(case["model_dir"]), device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=1, max_running=4
    )
    adapters: list[Path | None] = [*case["adapters"][:count], None]
    got = run_mixed(llm, case, adapters)
    for a in adapters:
        assert got[a] == case["refs"][a], a
    stats = llm.stats()
    assert stats["lora_slots_used"] == 1
    assert stats["lora_loads"] >= count and stats["lora_evictions"] >= count - 1
    assert stats["lora_reads"] > count - 1 and stats["lora_host_evictions"] >= 1
    llm.shutdown()


def test_a_bad_adapter_is_a_value_error_naming_it(case: dict[str, Any], tmp_path: Path) -> None:
    llm = LLM(str(case["model_dir"]), device="cpu", enable_lora=True, max_lora_rank=8)
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = [case["prompts"][0]]
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        llm.generate(prompt, sp, lora_request=LoRARequest("mlp", 3, str(case["adapters"][2])), use_tqdm=False)
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate(prompt, sp, lora_request=LoRARequest("gone", 4, str(tmp_path / "gone")), use_tqdm=False)
    first = LoRARequest("all", 1, str(case["adapters"][0]))
    llm.generate(prompt, sp, lora_request=first, use_tqdm=False)
    with pytest.raises(ValueError, match="LoRA id 1 is already"):
        llm.generate(prompt, sp, lora_request=LoRARequest("qv", 1, str(case["adapters"][1])), use_tqdm=False)
    plain = LLM(str(case["model_dir"]), device="cpu")
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(prompt, sp, lora_request=first, use_tqdm=False)


def test_unload_while_running_then_reload_stays_exact(case: dict[str, Any]) -> None:
    """Through one rank's scheduler: an adapter unloaded while its requests run (they finish with it, its
    slot is freed after them), then the same adapter again under a new id (read from disk again), between
    base requests and another adapter's: every output is the merged model's."""
    from tandem.engine.distributed import TPGroup
    from tandem.scheduler.messages import (
        AddRequest,
        LoadLora,
        SamplingSpec,
        SchedulerMsg,
        TokenOutput,
        UnloadLora,
    )
    from tandem.scheduler.runtime import RankRuntime, RuntimeOptions

    first, second = case["adapters"][0], case["adapters"][1]
    outputs: list[TokenOutput] = []
    options = RuntimeOptions.of(device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)
    runtime = RankRuntime(case["model_dir"], options, TPGroup(), outputs.extend)
    spec = SamplingSpec(max_tokens=MAX_NEW, temperature=0.0)
    prompts = case["prompts"]
    a1 = LoRARequest("first", 1, str(first))
    b2 = LoRARequest("second", 2, str(second))
    a3 = LoRARequest("first", 3, str(first))
    waves: list[list[SchedulerMsg]] = [
        [LoadLora(a1), AddRequest(0, prompts[0], spec, a1), AddRequest(1, prompts[1], spec, None)],
        [AddRequest(2, prompts[2], spec, b2), UnloadLora(1)],  # adapter 1 still runs request 0
        [AddRequest(3, prompts[3], spec, a3), AddRequest(4, prompts[0], spec, b2)],
    ]
    wanted = {0: (first, 0), 1: (None, 1), 2: (second, 2), 3: (first, 3), 4: (second, 0)}

    def receive(blocking: bool) -> list[SchedulerMsg]:
        return waves.pop(0) if waves else []

    for _ in range(200):
        runtime.step(receive)
        if not waves and not runtime.busy:
            break
    tokens: dict[int, list[int]] = {rid: [] for rid in wanted}
    for out in outputs:
        if out.token_id is not None:
            tokens[out.rid].append(out.token_id)
    for rid, (adapter, prompt) in wanted.items():
        assert tokens[rid] == case["refs"][adapter][prompt], rid
    stats = runtime.scheduler.stats()
    assert stats["lora_reads"] >= 3  # adapter 1, adapter 2, then adapter 1 again after its unload
    assert stats["lora_slots_used"] <= 2
