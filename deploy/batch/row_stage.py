"""The processor's engine stage: a batch of rows in, the same rows with the generated columns out.

A gpt-oss (harmony) model's chat rows are rendered as harmony and their replies read by channel:
`generated_text` is the final answer, `reasoning_content` the analysis (deploy/protocol/harmony).

Every row of a batch goes to the engine at once, and the actor runs several batches at once, so the
engine's queue never empties while rows remain. A row that cannot run gets an `error` and the job goes
on; an engine that fails ends the actor, and Ray retries its batches on a fresh one.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pyarrow as pa

from tandem.deploy.batch.host import EngineFailure, EngineHost, EngineSpec, exit_for_restart
from tandem.deploy.batch.rows import INPUT_COLUMNS, RowError, RowOutput, row_job, with_outputs
from tandem.deploy.batch.stage import EngineStage
from tandem.deploy.protocol.errors import OpenAIError
from tandem.deploy.protocol.jobs import JobRejected


class RowStage(EngineStage):
    def __init__(self, spec: EngineSpec, host: EngineHost | None = None) -> None:
        super().__init__(spec, host)
        self._ids = itertools.count()

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = request_fields(batch)
        try:
            outputs = await self._host.run(self._generate_all(rows))
        except EngineFailure as failure:
            exit_for_restart(failure)
        return with_outputs(batch, outputs)

    async def _generate_all(self, rows: list[dict[str, Any]]) -> list[RowOutput]:
        return list(await asyncio.gather(*(self._generate(row) for row in rows)))

    async def _generate(self, row: dict[str, Any]) -> RowOutput:
        harmony = self._host.harmony
        try:
            job = row_job(row, f"batch-{next(self._ids)}")
            # A gpt-oss chat row is rendered and stopped as harmony, as the server's chats are.
            job = harmony.prepare(job) if harmony is not None and job.messages is not None else job
        except RowError as exc:
            return RowOutput(error=str(exc))
        except OpenAIError as exc:  # what harmony cannot serve (an output constraint)
            return RowOutput(error=exc.message)
        started = time.perf_counter()
        try:
            run = await self._host.generation.start(job)
        except OpenAIError as exc:  # the replica refused the job (a rank down, shutting down)
            await self.ensure_healthy(exc.message)
            return RowOutput(error=exc.message)
        if isinstance(run, JobRejected):
            return RowOutput(error=f"{run.param}: {run.message}" if run.param else run.message)
        out = RowOutput(num_input_tokens=run.accepted.prompt_tokens[0])
        pieces: list[str] = []
        try:
            while not run.done:
                for delta in await run.next():
                    out.generated_tokens.extend(delta.token_ids)
                    pieces.append(delta.text)
                    if delta.finish_reason is not None:
                        out.finish_reason = delta.finish_reason
                        out.error = delta.error
        finally:
            await run.close()
        if out.finish_reason == "error":
            await self.ensure_healthy(out.error or "generation failed")
        out.generated_text = "".join(pieces)
        if harmony is not None and job.messages is not None:
            # Its reply read by channel: the final answer is the text, the analysis the reasoning.
            reply = harmony.read(out.generated_tokens, job)
            out.generated_text, out.reasoning_content = reply.content or "", reply.reasoning
        out.time_taken_llm = time.perf_counter() - started
        return out


def request_fields(batch: pa.Table) -> list[dict[str, Any]]:
    """Each row's `prompt`, `messages` and `sampling_params`, as Python values (None where absent)."""
    columns = {name: batch.column(name).to_pylist() for name in INPUT_COLUMNS if name in batch.column_names}
    return [{name: values[i] for name, values in columns.items()} for i in range(batch.num_rows)]
