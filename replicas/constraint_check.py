"""ConstraintCheck: compiles a request's output constraint on the replica, only to refuse a bad one
early with a 400. The ranks keep grammar caches of their own for decoding."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.scheduler.sampling_params import SamplingParams
from tandem.scheduler.structured.grammar import GrammarCache, hf_tokenizer_info

# A structured-output constraint that takes longer to compile is refused (a 400); its compile runs on.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class ConstraintCheck:
    def __init__(self, tokenizer: Any, timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._grammars = GrammarCache(lambda: hf_tokenizer_info(tokenizer, ()))

    async def problem(self, sampling: SamplingParams) -> str | None:
        """Why the request's constraint cannot be used, or None. Compiles run off the event loop, are
        bounded in time and are cached per distinct constraint."""
        if sampling.structured_outputs is None:
            return None
        try:
            future = self._grammars.compile(sampling.structured_outputs.spec())
            # shield: a timeout must not cancel the shared compile other requests may be waiting on.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except ValueError as exc:
            return str(exc)
        except TimeoutError:
            return f"it took longer than {self.timeout_s:g} s to compile"
        return None
