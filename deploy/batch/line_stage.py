"""The batch file's engine stage: input lines in, output lines out, each body answered by the same
`OpenAIService` and request path as the HTTP server's, on this actor's engine.

Admission lets twice the engine's batch in and queues the rest without bound. A 5xx is checked against
the engine's health: a dead rank ends the actor, so that Ray retries its lines on a fresh one, rather
than writing a line that only says the engine broke.
"""

from __future__ import annotations

import asyncio
import logging

import pyarrow as pa

from tandem.deploy.batch.host import EngineFailure, EngineHost, EngineSpec, exit_for_restart
from tandem.deploy.batch.lines import LineError, error_line, parse_line, response_line
from tandem.deploy.batch.stage import EngineStage
from tandem.deploy.config.args import DEFAULT_MAX_CHOICES_PER_REQUEST, DEFAULT_PROMPT_CHARS_PER_TOKEN
from tandem.deploy.generation.backend import ReplicaBackend
from tandem.deploy.guards.admission import Admission
from tandem.deploy.guards.limits import RequestLimits, prompt_chars_bound
from tandem.deploy.protocol.errors import OpenAIError, internal_error
from tandem.deploy.serving.openai_service import OpenAIService

logger = logging.getLogger(__name__)
LINE_COLUMN = "line"
STATUS_COLUMN = "status_code"  # the response's, or null for a line that is not a request
ADMITTED_PER_RUNNING = 2


class LineStage(EngineStage):
    def __init__(self, spec: EngineSpec, served_model_name: str, host: EngineHost | None = None) -> None:
        super().__init__(spec, host)
        replica = self._host.replica
        limits = RequestLimits(
            max_choices=DEFAULT_MAX_CHOICES_PER_REQUEST,
            max_prompt_chars=prompt_chars_bound(replica.max_model_len, DEFAULT_PROMPT_CHARS_PER_TOKEN),
        )
        # Twice what the engine runs, so the scheduler's own queue refills a finished slot at once; the
        # rest wait here, unbounded (a batch job is all queue), instead of as streams in the replica.
        admission = Admission(ADMITTED_PER_RUNNING * replica.max_running, -1)
        backend = ReplicaBackend(self._host.generation, admission)
        self._service = OpenAIService(
            backend, served_model_name, spec.model, limits=limits, harmony=self._host.harmony
        )

    async def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column("text").to_pylist()
        try:
            answers = await self._host.run(self._answer_all(texts))
        except EngineFailure as failure:
            exit_for_restart(failure)
        return pa.table(
            {
                LINE_COLUMN: pa.array([line for line, _ in answers], type=pa.string()),
                STATUS_COLUMN: pa.array([status for _, status in answers], type=pa.int64()),
            }
        )

    async def _answer_all(self, texts: list[str]) -> list[tuple[str, int | None]]:
        return list(await asyncio.gather(*(self._answer(text) for text in texts)))

    async def _answer(self, text: str) -> tuple[str, int | None]:
        """The output line for one input line, and its response's status (None: not a request)."""
        request = parse_line(text)
        if isinstance(request, LineError):
            return error_line(request), None
        try:
            response = await self._service.answer(request.url, request.body, allow_stream=False)
        except OpenAIError as refused:
            if refused.status >= 500:
                await self.ensure_healthy(refused.message)
            return response_line(request.custom_id, refused.status, refused.body()), refused.status
        except Exception:  # the HTTP server's 500 for a bug of ours: logged, answered, the job goes on
            logger.exception("batch line %s failed", request.custom_id)
            failed = internal_error()
            return response_line(request.custom_id, failed.status, failed.body()), failed.status
        assert isinstance(response, dict)  # streams were refused above
        return response_line(request.custom_id, 200, response), 200
