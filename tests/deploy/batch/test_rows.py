"""A processor row's request fields become a `GenerateJob`, or a `RowError` naming what is wrong; the
generated columns have one schema whatever the rows hold."""

from __future__ import annotations

import pyarrow as pa
import pytest

from tandem.deploy.batch.rows import (
    OUTPUT_SCHEMA,
    RowError,
    RowOutput,
    row_job,
    sampling_params,
    with_outputs,
)
from tandem.scheduler.sampling_params import StructuredOutputs


def test_a_text_prompt_and_its_sampling_params() -> None:
    job = row_job({"prompt": "hi", "sampling_params": {"temperature": 0.0, "max_tokens": 7}}, "r1")
    assert job.prompts == ["hi"] and job.messages is None
    assert job.sampling.temperature == 0.0 and job.max_tokens == job.sampling.max_tokens == 7
    assert job.request_id == "r1" and job.n == 1


def test_token_ids_and_messages() -> None:
    assert row_job({"prompt": [1, 2, 3]}, "r").prompts == [[1, 2, 3]]
    job = row_job({"messages": [{"role": "user", "content": "hi", "name": None}]}, "r")
    assert job.messages == [{"role": "user", "content": "hi"}] and job.prompts is None


def test_arrow_nulls_mean_defaults() -> None:
    # Arrow gives every row every key of a struct column: None where this row had none.
    params = sampling_params({"temperature": 0.5, "top_k": None, "stop": None, "seed": None})
    assert params.temperature == 0.5 and params.top_k == -1 and params.stop is None
    assert sampling_params(None).max_tokens == 16  # vLLM's default, as the offline API's


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({}, "exactly one of `prompt`"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of `prompt`"),
        ({"prompt": 5}, "prompt must be a string or a list of token ids"),
        ({"prompt": [1, "2"]}, "prompt must be a string or a list of token ids"),
        ({"prompt": [True, 1]}, "prompt must be a string or a list of token ids"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0: role"),
        ({"prompt": "a", "sampling_params": {"temperature": -1.0}}, "temperature must be >= 0"),
        ({"prompt": "a", "sampling_params": {"temprature": 0.0}}, "unknown field(s) temprature"),
        ({"prompt": "a", "sampling_params": {"max_tokens": 0}}, "max_tokens must be an int >= 1"),
        ({"prompt": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params:"),
        ({"prompt": "a", "sampling_params": [1]}, "sampling_params must be a dict"),
        ({"prompt": "a", "sampling_params": {"logprobs": 2}}, "logprobs are not returned"),
        (
            {"prompt": "a", "sampling_params": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "exactly one",
        ),
    ],
)
def test_bad_rows_say_why(row: dict, says: str) -> None:
    with pytest.raises(RowError) as raised:
        row_job(row, "r")
    assert says in str(raised.value)


def test_structured_outputs_and_logit_bias_from_arrow_shapes() -> None:
    params = sampling_params(
        {"structured_outputs": {"choice": ["yes", "no"], "regex": None}, "logit_bias": {"5": 1.0}}
    )
    assert params.structured_outputs == StructuredOutputs(choice=["yes", "no"])
    assert params.logit_bias == {5: 1.0}


def test_outputs_keep_the_rows_columns_and_replace_their_own() -> None:
    batch = pa.table({"id": [1, 2], "generated_text": ["stale", "stale"]})
    out = with_outputs(
        batch,
        [
            RowOutput("ab", [4, 5], 3, "length", 0.1),
            RowOutput(error="prompt must be a string"),
        ],
    )
    assert out.column_names == ["id", "generated_text", *[f.name for f in OUTPUT_SCHEMA][1:]]
    rows = out.to_pylist()
    assert (
        rows[0]["generated_text"] == "ab"
        and rows[0]["num_generated_tokens"] == 2
        and rows[0]["error"] is None
    )
    assert rows[1]["generated_tokens"] == [] and rows[1]["finish_reason"] is None
    assert rows[1]["error"] == "prompt must be a string"
    # A block of good rows only has the same schema as one with errors (no null-typed column).
    good = with_outputs(pa.table({"id": [1]}), [RowOutput("a", [1], 1, "stop")])
    assert good.schema.field("error").type == pa.string()
    assert good.schema.field("finish_reason").type == pa.string()
