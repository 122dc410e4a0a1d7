"""Structured outputs with xgrammar: compiled grammars (cached, compiled off the scheduler's thread),
one matcher per constrained request, and the token bitmasks the sampler applies.

Every TP rank compiles the same `GrammarSpec`s and accepts the same tokens, so every rank builds the
same masks and its seeded sampler draws the same tokens, with no broadcast. Compiles run on a worker
thread; a rank only waits for one when it first needs the request's mask, which is after the request's
prefill has been launched, so a fresh schema's compile overlaps that prefill on the device. The wait is
a block, never a skip: ranks must take identical scheduling decisions, which a "not compiled yet" test
racing a thread would break.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch
import xgrammar as xgr

from tandem.scheduler.messages import GrammarSpec
from tandem.scheduler.structured.json_strings import rewrite_schema_text

# Distinct grammars kept compiled (an LRU): a compiled JSON schema holds a per-token mask cache, of a
# few hundred KiB to a few MiB for a 150k vocabulary.
CACHE_ENTRIES = 256


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_spec(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """Raise ValueError with xgrammar's reason when the spec is not a grammar it accepts.

    JSON comes out compact (no free whitespace between tokens): a model may otherwise spend its budget
    on whitespace that the grammar allows without end. Bounded strings are rewritten first
    (json_strings.py), so they stay strict JSON.
    """
    try:
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(rewrite_schema_text(spec.text), any_whitespace=False)
        if spec.kind == "json_object":
            # OpenAI's JSON mode: any object. Non-strict, so it may carry properties of any name.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(spec.text)))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.text)
    except Exception as exc:  # xgrammar's parse and conversion errors (RuntimeError, InvalidJSONError...)
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ValueError(lines[-1]) from None
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


class GrammarCache:
    """Compiles `GrammarSpec`s on one worker thread, once per distinct spec (LRU of futures).

    The tokenizer's vocabulary info is built on that thread too, on first use: it walks the whole
    vocabulary, which for a 150k-token model takes about a second.
    """

    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo], entries: int = CACHE_ENTRIES) -> None:
        self._make_info = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._entries = entries

    def compile(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        future = self._futures.get(spec)
        if future is not None:
            self._futures.move_to_end(spec)
            return future
        future = self._pool.submit(self._compile, spec)
        self._futures[spec] = future
        while len(self._futures) > self._entries:
            self._futures.popitem(last=False)
        return future

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if self._compiler is None:
            # Our own LRU caches whole compiles; xgrammar's cache would grow without a bound.
            self._compiler = xgr.GrammarCompiler(self._make_info(), max_threads=4, cache_enabled=False)
        return compile_spec(self._compiler, spec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def hf_tokenizer_info(tokenizer: Any, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it: the ids the tokenizer has, and the end-of-sequence ids.

    Not the model's head, which is often padded past the tokenizer: those ids have no text, so no
    grammar accepts them, and the sampler masks them for constrained rows with one slice
    (`SamplingBatch.bitmask_vocab`). Given them, xgrammar clears their bits one by one in every row's
    mask at every step, which for a small tokenizer under a wide head costs more than the grammar.
    """
    ids = tokenizer.get_vocab().values()
    size = max(len(tokenizer), max(ids, default=-1) + 1, max(stop_token_ids, default=-1) + 1)
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=size, stop_token_ids=list(stop_token_ids) or None
    )


class GrammarState:
    """One request's constraint: its compile, then its matcher (made when first needed).

    `accept` records what the result processing reads (`refused`, `terminated`), so that processing
    never touches the matcher while a bitmask fill of the next step may be reading it on another thread.
    """

    def __init__(self, compiled: Future[xgr.CompiledGrammar], after_token: int | None = None) -> None:
        self._compiled = compiled
        # A reasoning model's end-of-thinking token: until it is sampled the output is free, and the
        # grammar constrains what follows it (its mask is all ones, its matcher is not fed).
        self.waiting_for = after_token
        self._matcher: xgr.GrammarMatcher | None = None
        self.vocab_size = 0  # xgrammar's vocabulary size (the bitmask's width), once compiled
        self.failed: str | None = None
        self.refused = False  # the last token offered was not accepted
        self.terminated = False  # the grammar is complete and its end-of-sequence token accepted

    def matcher(self) -> xgr.GrammarMatcher | None:
        """Blocks on the compile if it is still running; None (and `failed` set) if it failed."""
        if self._matcher is None and self.failed is None:
            try:
                compiled = self._compiled.result()
            except ValueError as exc:  # the replica validated the spec, so this is unexpected
                self.failed = str(exc)
                return None
            self._matcher = xgr.GrammarMatcher(compiled)
            self.vocab_size = compiled.tokenizer_info.vocab_size
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and `refused` set) if the grammar refuses it."""
        accept_tokens([self], [token])
        return not self.refused


def accept_tokens(states: list[GrammarState], tokens: list[int]) -> None:
    """Advance each state by its sampled token, in one call into xgrammar for the batch (per token, a
    Python call into the matcher costs more than the accept itself), and record `refused` and
    `terminated` on each."""
    live: list[tuple[GrammarState, xgr.GrammarMatcher]] = []
    offered: list[int] = []
    for state, token in zip(states, tokens, strict=True):
        if state.waiting_for is not None:
            if token == state.waiting_for:
                state.waiting_for = None  # the grammar starts with the next token
            state.refused = state.terminated = False
            continue
        matcher = state.matcher()
        if matcher is None:
            state.refused, state.terminated = True, False
        else:
            live.append((state, matcher))
            offered.append(token)
    if not live:
        return
    accepted = xgr.BatchGrammarMatcher.batch_accept_token([m for _, m in live], offered)
    for (state, matcher), ok in zip(live, accepted, strict=True):
        state.refused = not ok
        state.terminated = bool(matcher.is_terminated())


class _HostMasks:
    """One reusable host buffer of bitmask rows and their batch rows (pinned for the device's copies),
    with the event after which those copies have read it."""

    def __init__(self, rows: int, width: int, pin: bool) -> None:
        self.masks = torch.empty((rows, width), dtype=torch.int32, pin_memory=pin)
        self.rows = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        # Recorded after each upload from this buffer; made once, as pinned buffers exist only on GPUs.
        self.read = torch.cuda.Event() if pin else None

    def fits(self, rows: int, width: int) -> bool:
        return rows <= self.masks.shape[0] and width == self.masks.shape[1]


class BitmaskFiller:
    """Fills the bitmasks of a batch's constrained rows with xgrammar's batch matcher, on one thread: on
    the H200 host, splitting a fill over more threads made it slower, not faster (`mask_fill` in
    benchmarks/structured.py times both).

    `start` runs the fill on a worker thread and returns once the fill is under way. The fill releases
    the GIL, so the scheduler does its other host work meanwhile; but a thread that has just been
    handed work needs the GIL to reach that call, and the scheduler's thread, running Python, would only
    let it go when it blocks or after the interpreter's switch interval. So `start` waits for the worker
    to signal that it is entering the fill, which is the one hand-over of the GIL that lets the two
    overlap. The caller must not touch the rows' matchers until the future is done.

    The masks are written into two host buffers used in turn, kept across steps (pinned when the device
    is a GPU, so that `upload` copies them asynchronously): a step allocates nothing, and a buffer is
    written again only after the copies of its last upload have read it.
    """

    def __init__(self, *, pin: bool = False, threads: int | Literal["auto"] = 1) -> None:
        self._batch = xgr.BatchGrammarMatcher(threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask-fill")
        self._pin = pin
        self._buffers: list[_HostMasks | None] = [None, None]
        self._turn = 0

    def start(self, states: list[GrammarState]) -> Future[torch.Tensor]:
        """int32 [len(states), ceil(V/32)], when done: row i allows the tokens `states[i]` accepts next.
        The tensor is a view of a reused buffer, valid until the second `start` after this one.

        Matchers are made (and compiles waited for) here, on the caller's thread."""
        matchers = [state.matcher() for state in states]
        width = (max(max(state.vocab_size for state in states), 1) + 31) // 32
        buffer = self._next_buffer(len(states), width)
        bitmask = buffer.masks[: len(states)]
        live: list[tuple[int, xgr.GrammarMatcher]] = []
        for i, (state, matcher) in enumerate(zip(states, matchers, strict=True)):
            if matcher is not None and not state.terminated and state.waiting_for is None:
                live.append((i, matcher))  # the last accept left it live and past any reasoning
            else:  # a failed or finished row is dropped at result time; any token will do
                bitmask[i].fill_(-1)
        started = threading.Event()
        future = self._worker.submit(self._fill, bitmask, live, started)
        started.wait()
        return future

    def fill(self, states: list[GrammarState]) -> torch.Tensor:
        return self.start(states).result()

    def upload(
        self, bitmask: torch.Tensor, rows: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`bitmask` (from `start`, filled) and its batch `rows` on `device`, copied on the current stream."""
        buffer = next(b for b in self._buffers if b is not None and b.masks.data_ptr() == bitmask.data_ptr())
        index = buffer.rows[: len(rows)]
        index.numpy()[:] = rows
        on_device = bitmask.to(device, non_blocking=True), index.to(device, non_blocking=True)
        if buffer.read is not None:
            buffer.read.record()
        return on_device

    def _next_buffer(self, rows: int, width: int) -> _HostMasks:
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer is not None and buffer.read is not None:
            buffer.read.synchronize()  # its last copies are done (long since, as a rule; at once if none)
        if buffer is None or not buffer.fits(rows, width):
            capacity = max(rows, buffer.masks.shape[0] if buffer is not None else 0)
            buffer = self._buffers[self._turn] = _HostMasks(capacity, width, self._pin)
        return buffer

    def _fill(
        self, bitmask: torch.Tensor, live: list[tuple[int, xgr.GrammarMatcher]], started: threading.Event
    ) -> torch.Tensor:
        # xgrammar writes the rows through the tensor's pointer: no torch op here, so an inference-mode
        # tensor made on the caller's thread is fine.
        try:
            matchers, rows = [m for _, m in live], [i for i, _ in live]
        finally:
            started.set()  # whatever happens here, `start` must not wait for ever
        if live:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask
