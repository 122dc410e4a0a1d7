"""benchmarks/rank_ttft.py on CPU: the loop emits a request's first token one step later under overlap
(its prefill's results are processed after the next batch is launched) than without it."""

from __future__ import annotations

import time

from tandem.benchmarks.rank_ttft import measure, profile_table, python_profile
from tandem.engine.distributed import TPGroup
from tandem.engine.tiny.factory import default_model_dir
from tandem.scheduler.messages import TokenOutput
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions


def test_first_token_steps_with_and_without_overlap() -> None:
    for overlap, steps in ((True, 2), (False, 1)):
        emitted: list[float] = []

        def emit(outputs: list[TokenOutput], emitted: list[float] = emitted) -> None:
            emitted.append(time.perf_counter())

        runtime = RankRuntime(
            default_model_dir(), RuntimeOptions.of(device="cpu", overlap=overlap), TPGroup(), emit
        )
        row = measure(runtime, emitted, requests=3, prompt_len=8, max_tokens=3)
        assert row["steps_to_first_token"] == steps, (overlap, row)
        assert 0 < row["ttft_ms_p50"] <= row["e2e_ms_p50"]
        assert not runtime.busy


def test_profile_names_the_loop_phases_and_their_ops() -> None:
    emitted: list[float] = []

    def emit(outputs: list[TokenOutput]) -> None:
        emitted.append(time.perf_counter())

    runtime = RankRuntime(default_model_dir(), RuntimeOptions.of(device="cpu", overlap=True), TPGroup(), emit)
    table = profile_table(runtime, emitted, requests=2, prompt_len=8, max_tokens=2)
    for name in ("tandem.schedule", "tandem.launch", "tandem.process_results", "aten::mm"):
        assert name in table, name
    calls = python_profile(runtime, emitted, requests=2, prompt_len=8, max_tokens=2)
    assert "overlap_step" in calls and "cumulative" in calls
    assert not runtime.busy
