"""`tandem.batch` on a local Ray cluster (CPU): the processor's greedy rows equal `LLM.generate`'s, a bad
row gets an error column and the job goes on, and an actor killed mid-run loses and duplicates no row.
One Ray instance for the module; the reference outputs come from the offline `LLM` in this process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.data import DataContext

from tandem import LLM, SamplingParams
from tandem.batch import ProcessorConfig, build_processor
from tandem.deploy.batch.actor_group import GROUP_PREFIX, release_orphan_groups

STAGE_ACTOR = "MapWorker(MapBatches(RowStage))"
MAX_TOKENS = 12
ENGINE = {"page_size": 4}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    context = DataContext.get_current()
    saved = context.enable_progress_bars
    context.enable_progress_bars = False  # a test log has no terminal to draw on
    yield
    context.enable_progress_bars = saved
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> Path:
    return Path(tiny_model_dir("qwen3"))


def prompt_of(i: int) -> str:
    return f"row {i}: " + "the quick brown fox " * (1 + i % 5)


def reference(model: Path, ids: list[int], max_tokens: int) -> dict[int, Any]:
    llm = LLM(str(model), device="cpu", **ENGINE)
    try:
        outs = llm.generate(
            [prompt_of(i) for i in ids],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    return dict(zip(ids, outs))


def request_path_text(offline_text: str) -> str:
    """`LLM.generate` decodes a whole output at once, so an unfinished UTF-8 character at its end (a
    random model's byte tokens) reads as U+FFFD; the request path's incremental detokenizer, the HTTP
    server's and so the processor's, holds such a character back. Nothing else differs."""
    return offline_text.rstrip("\ufffd") if offline_text.endswith("\ufffd") else offline_text


def stage_actors() -> dict[str, dict[str, Any]]:
    """The engine stage's actors, dead or alive, by id (the GCS actor table; no dashboard here)."""
    import ray._private.state

    return {i: a for i, a in ray._private.state.actors().items() if a["ActorClassName"] == STAGE_ACTOR}


def live_groups() -> list[str]:
    return [
        str(g["name"])
        for g in ray.util.placement_group_table().values()
        if str(g.get("name", "")).startswith(GROUP_PREFIX) and g["state"] != "REMOVED"
    ]


BAD_ROWS: dict[int, tuple[dict[str, Any], str]] = {
    5: ({"prompt": "x", "sampling_params": {"temperature": -1.0}}, "temperature must be >= 0"),
    11: ({"prompt": "x", "sampling_params": {"max_tokens": 10**6}}, "exceeds the context length"),
    17: ({"prompt": "x", "sampling_params": {"temprature": 0.0}}, "unknown field(s) temprature"),
    23: ({"sampling_params": {"max_tokens": 4}}, "exactly one of `prompt`"),
}


def preprocess(row: dict[str, Any]) -> dict[str, Any]:
    i = int(row["id"])
    if i in BAD_ROWS:
        return BAD_ROWS[i][0]
    return {"prompt": prompt_of(i), "sampling_params": {"temperature": 0.0, "max_tokens": MAX_TOKENS}}


def test_greedy_rows_equal_llm_generate_and_bad_rows_get_an_error(ray_cluster: None, model: Path) -> None:
    rows_total, batch_size = 48, 8  # six batches over two actors
    config = ProcessorConfig(
        model_source=str(model),
        concurrency=2,
        batch_size=batch_size,
        max_concurrent_batches=2,
        device="cpu",
        engine_kwargs=ENGINE,
    )
    processor = build_processor(
        config,
        preprocess=preprocess,
        postprocess=lambda row: {"id": row["id"], "out": row["generated_text"], **row},
    )
    rows = processor(ray.data.range(rows_total)).take_all()
    assert sorted(int(r["id"]) for r in rows) == list(range(rows_total))
    good = [i for i in range(rows_total) if i not in BAD_ROWS]
    expected = reference(model, good, MAX_TOKENS)
    for row in rows:
        i = int(row["id"])
        if i in BAD_ROWS:
            assert BAD_ROWS[i][1] in row["error"], row
            assert list(row["generated_tokens"]) == [] and row["finish_reason"] is None
            continue
        want = expected[i]
        assert row["error"] is None, row
        assert list(row["generated_tokens"]) == want.token_ids, i
        assert row["generated_text"] == row["out"] == request_path_text(want.text)
        assert row["num_generated_tokens"] == len(want.token_ids)
        assert row["num_input_tokens"] == len(want.prompt_token_ids)
        assert row["finish_reason"] == want.finish_reason
        assert row["prompt"] == prompt_of(i)  # the input's columns and preprocess's stay
        assert row["time_taken_llm"] > 0
    assert len(stage_actors()) == 2  # concurrency=2: two engines
    # Each actor gave back its rank actors' placement group (or, if Ray Data killed it while it was
    # still starting, the next job's sweep does).
    deadline = time.monotonic() + 30
    while live_groups() and time.monotonic() < deadline:
        release_orphan_groups()
        time.sleep(0.5)
    assert live_groups() == []


def test_an_actor_and_a_rank_killed_mid_run_lose_and_duplicate_no_row(ray_cluster: None, model: Path) -> None:
    """One engine actor's process is killed (Ray restarts it and runs its batches again), then a rank of a
    running engine (its actor sees the engine fail, exits, and is restarted the same way)."""
    rows_total = 64  # sixteen batches, one at a time per actor: the kills land with work left
    before = set(stage_actors())
    config = ProcessorConfig(
        model_source=str(model),
        concurrency=2,
        batch_size=4,
        max_concurrent_batches=1,
        device="cpu",
        engine_kwargs=ENGINE,
    )
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    processor = build_processor(
        config, preprocess=lambda row: {"prompt": prompt_of(int(row["id"])), "sampling_params": params}
    )
    rows = iter(processor(ray.data.range(rows_total)).iter_rows())
    got = [next(rows)]
    alive = {i: a for i, a in stage_actors().items() if i not in before and a["State"] == "ALIVE"}
    assert alive, "no engine actor to kill"
    victim, actor = next(iter(alive.items()))
    os.kill(int(actor["Pid"]), signal.SIGKILL)  # as the OOM killer would: no cleanup, no goodbye
    rank = running_rank(before, exclude_owner=actor)
    os.kill(int(rank["Pid"]), signal.SIGKILL)
    got += list(rows)
    ids = sorted(int(r["id"]) for r in got)
    assert ids == list(range(rows_total)), "rows lost or duplicated"
    actors = stage_actors()
    assert actors[victim]["NumRestarts"] >= 1  # Ray restarted it and ran its batches again
    assert sum(a["NumRestarts"] for i, a in actors.items() if i not in before) >= 2  # and the rank's
    expected = reference(model, list(range(rows_total)), MAX_TOKENS)
    for row in got:
        assert row["error"] is None
        assert list(row["generated_tokens"]) == expected[int(row["id"])].token_ids


def running_rank(before: set[str], exclude_owner: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """A live rank actor whose engine actor is up (not the one just killed), once there is one."""
    import ray._private.state

    def where(address: dict[str, Any]) -> tuple[Any, Any]:
        return address.get("IPAddress"), address.get("Port")

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        owners = {
            where(a["Address"])
            for i, a in stage_actors().items()
            if i not in before
            and a["State"] == "ALIVE"
            and where(a["Address"]) != where(exclude_owner["Address"])
        }
        for rank in ray._private.state.actors().values():
            live = "RankWorker" in rank["ActorClassName"] and rank["State"] == "ALIVE"
            if live and where(rank["OwnerAddress"]) in owners:
                return dict(rank)
        time.sleep(0.2)
    raise AssertionError("no running engine's rank to kill")


def test_tp2_actors_get_their_ranks_through_their_own_placement_group(ray_cluster: None, model: Path) -> None:
    rows_total = 12
    config = ProcessorConfig(
        model_source=str(model), tp_size=2, batch_size=4, device="cpu", engine_kwargs=ENGINE
    )
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    processor = build_processor(
        config, preprocess=lambda row: {"prompt": prompt_of(int(row["id"])), "sampling_params": params}
    )
    rows = processor(ray.data.range(rows_total)).take_all()
    expected = reference(model, list(range(rows_total)), MAX_TOKENS)
    for row in rows:
        assert list(row["generated_tokens"]) == expected[int(row["id"])].token_ids
    groups = [g for g in ray.util.placement_group_table().values() if str(g["name"]).startswith(GROUP_PREFIX)]
    assert {len(g["bundles"]) for g in groups} >= {2}  # one bundle per rank, as a serving replica's
