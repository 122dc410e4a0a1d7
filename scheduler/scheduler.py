"""The scheduler of one rank: admit, schedule, launch and process batches, in the normal or overlap loop.

Every TP rank runs this same code on the same messages, so all containers are insertion-ordered and
every decision is deterministic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tandem.engine.streams import StreamSet
from tandem.scheduler.batch_builder import BatchBuilder, PreparedBatch, Row
from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.inflight import EngineLike, InFlight, InflightPageGuard, Launcher
from tandem.scheduler.kv_manager import KVManager
from tandem.scheduler.lora_slots import AdapterSlots
from tandem.scheduler.messages import (
    AbortRequest,
    AddRequest,
    LoadLora,
    SchedulerMsg,
    TokenOutput,
    UnloadLora,
)
from tandem.scheduler.request import Request
from tandem.scheduler.results import ResultProcessor
from tandem.scheduler.spec.decoding import SpecDecoding
from tandem.scheduler.step_timer import StepTimer
from tandem.scheduler.structured.grammar import GrammarCache, GrammarState
from tandem.scheduler.table import RequestTable

MessageSource = Callable[[bool], list[SchedulerMsg]]
logger = logging.getLogger(__name__)
# Waiting requests one pass may step over because their adapter has no slot, before it stops looking.
MAX_PASSED_OVER = 256


class Scheduler:
    """Owns the request queues, the KV manager and the token pool of one rank."""

    def __init__(
        self,
        config: SchedulerConfig,
        engine: EngineLike,
        kv: KVManager,
        streams: StreamSet,
        eos_token_ids: tuple[int, ...],
        emit: Callable[[list[TokenOutput]], None],
        grammars: GrammarCache | None = None,
        lora: AdapterSlots | None = None,
        spec: SpecDecoding | None = None,
    ) -> None:
        self.config = config
        self.timer = StepTimer()  # wall time per loop phase (see step_timer.py)
        self.engine = engine
        self.kv = kv
        self.streams = streams
        self.device = streams.device
        self.table = RequestTable(
            config.max_running, config.max_seq_len, kv.page_size, len(kv.groups), self.device
        )
        lag = spec.draft_lag if spec is not None else None  # None: no drafter writes drafts on the device
        self.builder = BatchBuilder(
            self.table, kv, self.device, eos_token_ids, lora=lora is not None, draft_lag=lag
        )
        self.grammars = grammars
        self.lora = lora
        self._planned: PreparedBatch | None = None  # the overlap loop's next batch, when planned early
        self.has_window = any(g.window is not None for g in kv.groups)
        # Window groups reserve pages for one step of prefill length; drafted rows are off there for now.
        self.spec = spec if not self.has_window else None
        self.launcher = Launcher(engine, self.table, streams, self.spec)
        self.waiting: dict[int, Request] = {}
        self.running: dict[int, Request] = {}
        self.results = ResultProcessor(config.max_seq_len, eos_token_ids, emit)
        self.next_batch_id = 0
        self.last_processed = -1
        self.page_guard = InflightPageGuard(config.guard_inflight_pages)

    # ---- messages --------------------------------------------------------------------------
    def handle(self, msg: SchedulerMsg) -> None:
        if isinstance(msg, AddRequest):
            total = min(len(msg.prompt_ids) + msg.sampling.max_tokens, self.config.max_seq_len)
            if not msg.prompt_ids or self.kv.never_fits(len(msg.prompt_ids), total) is not None:
                # The replica validates first; this only keeps a bad message from queueing forever.
                self.results.emit_finish(msg.rid, "abort")
                return
            if msg.lora is not None and (self.lora is None or self.lora.prefetch(msg.lora) is not None):
                # The replica checks adapters first; this only keeps one that cannot be read from waiting.
                self.results.emit_finish(msg.rid, "abort")
                return
            seed = Request.derive_seed(self.config.seed, msg.rid, msg.sampling.seed)
            req = Request(msg.rid, list(msg.prompt_ids), msg.sampling, seed, lora=msg.lora)
            if msg.sampling.grammar is not None:
                if self.grammars is None:
                    self.results.emit_finish(msg.rid, "abort")
                    return
                # The compile starts now, on its thread; the matcher is first needed after the prefill.
                spec = msg.sampling.grammar
                req.grammar = GrammarState(self.grammars.compile(spec), after_token=spec.after_token)
            self.waiting[msg.rid] = req
        elif isinstance(msg, AbortRequest):
            self._abort(msg.rid)
        elif isinstance(msg, LoadLora) and self.lora is not None:
            problem = self.lora.prefetch(msg.lora)
            if problem is not None:
                logger.warning("LoRA adapter %r not read: %s", msg.lora.name, problem)
        elif isinstance(msg, UnloadLora) and self.lora is not None:
            self.lora.forget(msg.lora_int_id)

    def _abort(self, rid: int) -> None:
        if rid in self.waiting:
            del self.waiting[rid]
            self.results.emit_finish(rid, "abort")
            return
        req = self.running.get(rid)
        if req is None or req.finish_reason is not None:
            return
        req.finish_reason = "abort"
        self.results.emit_finish(rid, "abort")
        self._release_if_idle(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self._planned is not None

    # ---- scheduling ------------------------------------------------------------------------
    def _schedule(self) -> PreparedBatch | None:
        self.kv.flush(self.last_processed)
        newest_launched = self.next_batch_id - 1
        rows: list[Row] = []
        budget = self.config.chunk_size
        for req in self.running.values():
            # A row with drafts in flight leaves kv_len ahead of device_len: skipped until verified.
            if req.finish_reason is not None or req.kv_len >= req.device_len:
                continue
            drafts: tuple[int, ...] = ()
            if req.in_prefill:
                if budget <= 0:
                    continue
                length = min(req.prompt_len - req.kv_len, budget)
                budget -= length
            elif req.wants_more(self.config.max_seq_len):
                if self.spec is not None:
                    found = self.spec.drafts(req)
                    if found is None:
                        continue
                    drafts = found
                length = 1 + len(drafts)
            else:
                continue
            rows.append(self._row(req, length, newest_launched, drafts))
        if self.waiting and budget > 0 and self.table.num_free > 0:
            self._admit(rows, budget, newest_launched)
        if not rows:
            return None
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        prepared = self.builder.build(batch_id, rows)
        for row in rows:
            row.req.kv_len = row.start + row.length
            row.req.last_batch = batch_id
            if row.samples:
                row.req.device_len += 1
        self.page_guard.launched(batch_id, rows)
        return prepared

    def _admit(self, rows: list[Row], budget: int, newest_launched: int) -> None:
        """Admit waiting requests in order while the budget, the table and the KV pool allow: FIFO for
        pages (a request that does not fit stops admission, so later ones never overtake it for pages).
        A request whose adapter has no slot is stepped over (lora_slots.py), keeping its place."""
        if self.lora is not None:
            self.lora.begin_pass()
        taken: list[int] = []
        passed_over = 0
        for req in self.waiting.values():
            if budget <= 0 or self.table.num_free == 0 or passed_over > MAX_PASSED_OVER:
                break
            if req.lora is not None and not self._take_adapter(req, taken):
                passed_over += 1
                continue
            total = min(req.prompt_len + req.sampling.max_tokens, self.config.max_seq_len)
            if not self.kv.admit(req, total):
                if req.lora is not None and self.lora is not None:
                    self.lora.release(req.lora.id)
                    req.lora_slot = -1
                break
            taken.append(req.rid)
            req.slot = self.table.acquire()
            self.builder.admit(req)
            self.running[req.rid] = req
            with self.streams.use(self.streams.scheduler):
                self.table.write_prompt(req.slot, req.prompt_ids, self.device.type == "cuda")
            for g in range(len(self.kv.groups)):
                self.table.set_pages(g, req.slot, 0, req.pages[g])
            length = min(req.prompt_len - req.kv_len, budget)
            budget -= length
            rows.append(self._row(req, length, newest_launched))
        for rid in taken:
            del self.waiting[rid]

    def _take_adapter(self, req: Request, taken: list[int]) -> bool:
        """Give a waiting request its adapter's slot (loading it there on the scheduler stream, ahead of
        the batch), or say it must wait; one whose adapter can no longer be read ends (abort)."""
        assert req.lora is not None and self.lora is not None
        if not self.lora.admissible(req.lora):
            return False
        try:
            with self.streams.use(self.streams.scheduler):
                req.lora_slot = self.lora.acquire(req.lora)
        except (OSError, ValueError) as exc:
            logger.warning("request %d: LoRA adapter %r cannot be read: %s", req.rid, req.lora.name, exc)
            taken.append(req.rid)
            self.results.emit_finish(req.rid, "abort")
            return False
        return True

    def _row(self, req: Request, length: int, newest_launched: int, drafts: tuple[int, ...] = ()) -> Row:
        start = req.kv_len
        if self.has_window:
            self.kv.evict_window(req, start, newest_launched)
        for g, first, new in self.kv.grow(req, start + length):
            self.page_guard.check_new(g, new)
            self.table.set_pages(g, req.slot, first, new)
        samples = start + length - len(drafts) == req.device_len
        return Row(req, start, length, samples, drafts)

    # ---- launch and results ----------------------------------------------------------------
    def _process(self, done: InFlight, pending: InFlight | None = None) -> None:
        """Process a finished batch. `pending`, a launched batch whose constrained rows wait for their
        masks: those are filled on the filler's worker while this batch's results are processed."""
        assert done.output is not None, "a batch is sampled before it is processed"
        with self.timer.phase("wait"):  # blocked on the device: the rest of the step is host time
            done.output.copy_done.synchronize()
        rows = done.prepared.rows
        tokens = self.results.accept_constrained(rows, done.output, done.grammar_rows)
        if pending is not None:
            self.launcher.start_masks(pending)
        batch_id = done.prepared.batch_id
        self.last_processed = batch_id
        self.page_guard.processed(batch_id)
        self.kv.flush(batch_id)
        drafted = self.spec is not None and done.prepared.spec is not None
        # A drafted batch's rows of requests that ended while it was in flight: their tokens are dropped.
        dropped = [row.req.finish_reason is not None for row in rows] if drafted else []
        self.results.process(rows, done.output, tokens, done.prepared.prompt_rows)
        if drafted:
            assert self.spec is not None and done.prepared.spec is not None
            self.spec.verified(rows, done.prepared.spec, done.output, dropped)
        for row in rows:
            if row.req.finish_reason is not None:
                self._release_if_idle(row.req)

    def _release_if_idle(self, req: Request) -> None:
        """Free a finished request once no unprocessed batch contains it (the deferred-free rule)."""
        if req.released or req.last_batch > self.last_processed:
            return
        self.kv.release(req, req.prompt_ids + req.output_ids)
        self.table.release(req.slot)
        if req.lora is not None and self.lora is not None:
            self.lora.release(req.lora.id)
        del self.running[req.rid]

    # ---- the loops -------------------------------------------------------------------------
    def normal_step(self, receive: MessageSource) -> None:
        """Schedule a batch, run it, and process it at once (the ablation baseline)."""
        assert self.streams.is_current(self.streams.scheduler), "normal loop runs on the scheduler stream"
        for msg in receive(not self.has_work):
            self.handle(msg)
        with self.timer.phase("schedule"):
            prepared = self._schedule()
        if prepared is not None:
            with self.timer.phase("launch"):
                done = self.launcher.launch(prepared)
            with self.timer.phase("process_results"):
                self._process(done)

    def overlap_step(self, receive: MessageSource, last: InFlight | None) -> InFlight | None:
        """Launch batch N on the engine stream, then process batch N-1 while N runs."""
        assert self.streams.is_current(self.streams.scheduler), "overlap loop schedules on its stream"
        prepared, self._planned = self._planned, None
        for msg in receive(last is None and prepared is None and not self.has_work):
            self.handle(msg)
        if prepared is None:
            with self.timer.phase("schedule"):
                prepared = self._schedule()
        ongoing = None
        if prepared is not None:
            with self.streams.use(self.streams.engine), self.timer.phase("launch"):
                self.streams.wait(self.streams.engine, on=self.streams.scheduler)
                assert self.streams.is_current(self.streams.engine)
                ongoing = self.launcher.launch(prepared, defer_masks=True)
        pending = ongoing if ongoing is not None and ongoing.output is None else None
        if last is not None:
            with self.timer.phase("process_results"):
                # Structured-output rows in N+1: once N's tokens are accepted their masks are exact, and
                # they fill while the rest of N is processed and the forward of N+1 runs on the device.
                self._process(last, pending)
        if pending is not None:
            if pending.bitmask is not None:
                # The next batch is planned while the masks fill. It needs the results processed so far
                # (finished requests leave it), not this batch's tokens, which it reads from the token
                # pool on the device; and planning touches no matcher.
                with self.timer.phase("schedule"):
                    self._planned = self._schedule()
                with self.timer.phase("mask_wait"):  # the fill's time past the rest of the step's host work
                    pending.bitmask.result()
            with self.streams.use(self.streams.engine), self.timer.phase("masked_sample"):
                self.launcher.sample(pending)
        return ongoing

    def stats(self) -> dict[str, Any]:
        """KV and queue counts, and the loop's wall time per phase since it started (`step_phases`,
        step_timer.py), so a rank inside a Ray actor can be compared with one run in process."""
        stats: dict[str, Any] = dict(self.kv.stats())
        stats["num_running"] = sum(1 for r in self.running.values() if r.finish_reason is None)
        stats["num_waiting"] = len(self.waiting)
        stats["step_phases"] = self.timer.summary()
        if self.lora is not None:
            stats.update(self.lora.stats())
        if self.spec is not None:
            stats.update(self.spec.stats())
        return stats
