"""Turn a processed batch's host tokens into per-request outputs and finish decisions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.engine.batch import ForwardOutput
from tandem.scheduler.batch_builder import Row
from tandem.scheduler.messages import TokenOutput
from tandem.scheduler.request import Request
from tandem.scheduler.structured.grammar import GrammarState, accept_tokens


class ResultProcessor:
    def __init__(
        self, max_seq_len: int, eos_token_ids: tuple[int, ...], emit: Callable[[list[TokenOutput]], None]
    ) -> None:
        self.max_seq_len = max_seq_len
        self.eos = frozenset(eos_token_ids)
        self.emit = emit

    def emit_finish(self, rid: int, reason: str) -> None:
        self.emit([TokenOutput(rid, None, reason)])

    def accept_constrained(
        self, rows: list[Row], output: ForwardOutput, grammar_rows: list[int] | None
    ) -> list[Any]:
        """The batch's tokens (per row: one, or a list of them in a batch with drafts), after advancing
        the matcher of each of its `grammar_rows` (the rows that sampled under a constraint, which never
        carry drafts) by its token. Apart from `process`, so the next batch's bitmasks can be filled
        while the rest is processed."""
        tokens: list[Any] = output.next_tokens_host.tolist()
        drafted = output.accepted_host is not None
        states: list[GrammarState] = []
        offered: list[int] = []
        for i in grammar_rows or ():
            req = rows[i].req
            if req.finish_reason is None and req.grammar is not None:
                states.append(req.grammar)
                offered.append(tokens[i][0] if drafted else tokens[i])
        accept_tokens(states, offered)
        return tokens

    def process(
        self,
        rows: list[Row],
        output: ForwardOutput,
        tokens: list[Any],
        prompt_rows: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """Append each sampling row's token (`tokens`, from `accept_constrained`) and decide finishes.
        `prompt_rows`: (row, positions) whose prompt log-probs `output.prompt` holds, in order; a request's
        are sent with its first token, once its whole prompt is scored. In a batch with drafts a row
        emits its accepted tokens one by one, so stops, max_tokens and log-probs see exactly those, and
        none after a finish."""
        if prompt_rows:
            self._take_prompt_logprobs(rows, output, prompt_rows)
        logprobs = output.logprobs_host.tolist() if output.logprobs_host is not None else None
        top_ids = output.top_ids_host.tolist() if output.top_ids_host is not None else None
        top_vals = output.top_logprobs_host.tolist() if output.top_logprobs_host is not None else None
        accepted = output.accepted_host.tolist() if output.accepted_host is not None else None
        outs: list[TokenOutput] = []
        for i, row in enumerate(rows):
            req = row.req
            # Rows mid-prefill produce nothing; a request that finished while this batch was in
            # flight got one wasted step, whose token is dropped here.
            if not row.samples or req.finish_reason is not None:
                continue
            if accepted is None:
                outs.append(self._emit(req, int(tokens[i]), logprobs, top_ids, top_vals, (i,)))
                continue
            for j in range(accepted[i]):
                outs.append(self._emit(req, int(tokens[i][j]), logprobs, top_ids, top_vals, (i, j)))
                if req.finish_reason is not None:
                    break
        if outs:
            self.emit(outs)

    def _emit(
        self,
        req: Request,
        token: int,
        logprobs: list[Any] | None,
        top_ids: list[Any] | None,
        top_vals: list[Any] | None,
        at: tuple[int, ...],
    ) -> TokenOutput:
        """Append one token to `req`, decide whether it finishes there, and say so; `at`: the token's
        index in the host copies, (row,) or (row, position)."""
        req.output_ids.append(token)
        spec = req.sampling
        if req.grammar is not None and req.grammar.refused:
            # Masked sampling only draws allowed tokens, so this is a failed compile (or a bug).
            req.finish_reason = "abort"
        elif (
            token in spec.stop_token_ids
            or (not spec.ignore_eos and token in self.eos)
            or (req.grammar is not None and req.grammar.terminated)
        ):
            req.finish_reason = "stop"
        elif (
            len(req.output_ids) >= spec.max_tokens or req.prompt_len + len(req.output_ids) >= self.max_seq_len
        ):
            req.finish_reason = "length"
        logprob = top = None
        if spec.logprobs is not None and logprobs is not None:
            logprob = float(_at(logprobs, at))
            if spec.logprobs > 0 and top_ids is not None and top_vals is not None:
                top = list(zip(_at(top_ids, at)[: spec.logprobs], _at(top_vals, at)[: spec.logprobs]))
        first = len(req.output_ids) == 1
        cached = req.num_cached_tokens if first else None  # the first token carries it
        prompt = prompt_top = None
        if first and spec.prompt_logprobs is not None:
            prompt = req.prompt_logprobs
            prompt_top = req.prompt_top_logprobs if spec.prompt_logprobs > 0 else None
        return TokenOutput(req.rid, token, req.finish_reason, logprob, top, cached, prompt, prompt_top)

    @staticmethod
    def _take_prompt_logprobs(
        rows: list[Row], output: ForwardOutput, prompt_rows: tuple[tuple[int, int], ...]
    ) -> None:
        assert output.prompt is not None, "a batch that listed prompt positions returns their log-probs"
        values: list[float] = output.prompt.logprobs.tolist()
        ids = output.prompt.top_ids.tolist() if output.prompt.top_ids is not None else None
        tops = output.prompt.top_logprobs.tolist() if output.prompt.top_logprobs is not None else None
        at = 0
        for i, count in prompt_rows:
            req = rows[i].req
            req.prompt_logprobs.extend(values[at : at + count])
            wanted = req.sampling.prompt_logprobs or 0
            if wanted > 0 and ids is not None and tops is not None:
                req.prompt_top_logprobs.extend(
                    list(zip(ids[j][:wanted], tops[j][:wanted])) for j in range(at, at + count)
                )
            at += count


def _at(values: list[Any], at: tuple[int, ...]) -> Any:
    for i in at:
        values = values[i]
    return values
