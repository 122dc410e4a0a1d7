"""The batch stages on a tiny gpt-oss: the processor's chat rows are rendered and stopped as harmony, and
each reply is read by channel (`generated_text` the final answer, `reasoning_content` the analysis); a
batch file's chat completions carry `reasoning_content` on the message, as the server's do.

The stage runs in process over the tiny gpt-oss's own tokenizer and config; the replica at the test's edge
writes a scripted harmony reply, since a tiny random model writes no harmony.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from transformers import AutoTokenizer

from tandem.deploy.batch.host import EngineSpec, chat_service
from tandem.deploy.batch.line_stage import LineStage
from tandem.deploy.batch.row_stage import RowStage
from tandem.engine.config import ModelConfig

from ..harmony_fakes import HarmonyReplica
from ..harmony_tokenizer import encode

ANALYSIS = "<|channel|>analysis<|message|>They ask about Paris.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Sunny, 20°C — enjoy Paris.<|return|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]


class InProcessHost:
    """What RowStage uses of an EngineHost, over a replica in this process (chat_service is the host's)."""

    def __init__(self, replica: HarmonyReplica, chat_template: str | None = None) -> None:
        self.replica = replica
        self.harmony, self.generation = chat_service(replica, chat_template)

    async def run(self, coro: Any) -> Any:
        return await coro

    def close(self) -> None:
        pass


def stage_over(model_dir: Path, reply: str) -> tuple[RowStage, InProcessHost]:
    replica = HarmonyReplica(reply, AutoTokenizer.from_pretrained(model_dir))
    replica.model_type = ModelConfig.from_dir(model_dir).model_type  # what LLMReplica.start sets
    replica.vocab_size = len(replica.tokenizer)
    host = InProcessHost(replica)
    return RowStage(EngineSpec(str(model_dir)), host), host  # type: ignore[arg-type]


def test_chat_rows_are_harmony_and_read_by_channel(tiny_model_dir: Callable[..., Path]) -> None:
    stage, host = stage_over(tiny_model_dir("gpt_oss"), ANALYSIS + FINAL)
    assert host.harmony is not None and host.generation is not None
    batch = pa.table(
        {
            "messages": [CHAT, CHAT, CHAT],
            "sampling_params": [
                {"max_tokens": 100, "stop": None},
                {"max_tokens": 100, "stop": ["enjoy Pa"]},
                {"max_tokens": 100, "stop": None, "structured_outputs": {"json": {"type": "object"}}},
            ],
        }
    )
    rows = asyncio.run(stage(batch)).to_pylist()
    whole, stopped, constrained = rows
    assert (whole["generated_text"], whole["reasoning_content"]) == (
        "Sunny, 20°C — enjoy Paris.",
        "They ask about Paris.",
    )
    assert whole["finish_reason"] == "stop" and whole["error"] is None
    tokenizer = host.replica.tokenizer
    assert whole["generated_tokens"] == encode(tokenizer, ANALYSIS + FINAL)  # up to <|return|>
    assert (stopped["generated_text"], stopped["reasoning_content"]) == (
        "Sunny, 20°C — ",
        "They ask about Paris.",
    )
    assert (
        constrained["error"].startswith("sampling_params.structured_outputs cannot")
        and constrained["generated_text"] == ""
    )
    # The prompt is harmony, from tandem's template (the tiny gpt-oss ships none), with the default effort;
    # the reply stops at <|return|> and <|call|>.
    assert tokenizer.chat_template is None
    prompt = tokenizer.decode(host.replica.prompts[0])
    assert prompt.startswith("<|start|>system<|message|>") and "Reasoning: medium" in prompt
    assert prompt.endswith("<|start|>user<|message|>Paris?<|end|><|start|>assistant")
    assert "# Instructions\n\nBe brief." in prompt
    stops = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    assert all(set(stops) <= set(s.stop_token_ids or []) for s in host.replica.samplings)


def test_prompt_rows_are_left_as_they_are(tiny_model_dir: Callable[..., Path]) -> None:
    stage, host = stage_over(tiny_model_dir("gpt_oss"), ANALYSIS + FINAL)
    (row,) = asyncio.run(
        stage(pa.table({"prompt": ["Paris?"], "sampling_params": [{"max_tokens": 9}]}))
    ).to_pylist()
    # A raw prompt is the caller's own rendering: its text is the detokenized reply, no harmony reading.
    text = host.replica.tokenizer.decode(
        encode(host.replica.tokenizer, ANALYSIS)[:9], skip_special_tokens=True
    )
    assert row["reasoning_content"] is None and row["generated_text"] == text
    assert text.startswith("analysisThey")  # the header's word too: nothing was read by channel
    assert host.replica.samplings[0].stop_token_ids in (None, [])


def test_batch_file_chat_lines_carry_the_reasoning(tiny_model_dir: Callable[..., Path]) -> None:
    model_dir = tiny_model_dir("gpt_oss")
    _, host = stage_over(model_dir, ANALYSIS + FINAL)
    host.replica.max_running = 4  # type: ignore[attr-defined]  # what LineStage admits by
    stage = LineStage(EngineSpec(str(model_dir)), "tiny-gpt-oss", host)  # type: ignore[arg-type]
    body = {"model": "tiny-gpt-oss", "messages": CHAT, "reasoning_effort": "low"}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    (out,) = asyncio.run(stage(pa.table({"text": [json.dumps(line)]}))).to_pylist()
    response = json.loads(out["line"])["response"]
    assert out["status_code"] == response["status_code"] == 200
    message = response["body"]["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Sunny, 20°C — enjoy Paris.",
        "reasoning_content": "They ask about Paris.",
    }
    assert "Reasoning: low" in host.replica.tokenizer.decode(host.replica.prompts[0])
