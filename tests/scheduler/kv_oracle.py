"""A stand-in engine that checks the KV every batch reads, for scheduler-level tests of paging and the
prefix caches: no model, just labels.

Every KV slot holds a label, the adapter and the exact tokens up to and including its position (what the
real KV there depends on). A batch checks, for each row, that every key its queries read (all earlier
positions in a full group; the last `window` in a window group, from the group's `kv_start` on) holds the
label of that row's own sequence, then labels its new positions. When the batch is processed, it checks
again that nothing it read or wrote was overwritten meanwhile: a page reused while a batch in flight
could still read it (the deferred-release rule) shows up there. The next token is a hash of the row's
labelled sequence, so outputs depend on the whole prefix, as a model's would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.engine.batch import ForwardBatch, ForwardOutput, PromptLogprobs
from tandem.engine.streams import StreamSet
from tandem.scheduler.batch_builder import PreparedBatch, Row
from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.inflight import InFlight
from tandem.scheduler.kv_manager import GroupInfo, KVManager
from tandem.scheduler.lora_slots import AdapterSlots
from tandem.scheduler.messages import SchedulerMsg, TokenOutput
from tandem.scheduler.scheduler import Scheduler

Label = tuple[int, tuple[int, ...]]  # (adapter id, tokens up to the position)


class KVMismatch(AssertionError):
    """A batch read a key that does not hold its row's KV."""


@dataclass
class _Check:
    """Slots a launched batch read or wrote, with the label each held; checked again when processed."""

    seen: list[tuple[int, int, Label]] = field(default_factory=list)
    done: bool = False


class _Processed:
    """The copy-done event of a batch: synchronizing it re-checks what the batch read."""

    def __init__(self, engine: LabelEngine, check: _Check) -> None:
        self.engine, self.check = engine, check

    def record(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if not self.check.done:
            self.check.done = True
            self.engine.recheck(self.check)


class LabelEngine:
    """`EngineLike` over labels; `rows` is set to the launched batch's rows before each forward."""

    def __init__(self, windows: list[int | None], page_size: int, vocab: int = 50) -> None:
        self.windows = windows
        self.page_size = page_size
        self.vocab = vocab
        self.kv: list[dict[int, Label]] = [{} for _ in windows]
        self.sequences: dict[int, list[int]] = {}  # rid -> tokens fed so far (prompt first)
        self.rows: list[Row] = []
        self.reads = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        ps = self.page_size
        inputs = batch.input_ids.tolist()
        check = _Check()
        next_tokens = []
        at = 0
        for b, row in enumerate(self.rows):
            req = row.req
            adapter = req.lora.id if req.lora is not None else 0
            seq = self.sequences.setdefault(req.rid, list(req.prompt_ids))
            new = inputs[at : at + row.length]
            at += row.length
            start = row.start
            for i, token in enumerate(new):  # the token pool must feed the row its own tokens
                pos = start + i
                if pos < len(seq):
                    assert seq[pos] == token, (
                        f"rid {req.rid}: token {token} fed at {pos}, expected {seq[pos]}"
                    )
                else:
                    assert pos == len(seq), f"rid {req.rid}: position {pos} fed past {len(seq)}"
                    seq.append(token)
            for g, window in enumerate(self.windows):
                group = batch.groups[g]
                table = group.page_table_cpu[b].tolist()
                kv_start = int(group.kv_start_cpu[b])
                lo = 0 if window is None else max(0, start - window + 1)  # the first query's oldest key
                if kv_start > lo:
                    raise KVMismatch(f"rid {req.rid} group {g}: kv_start {kv_start} past key {lo}")
                for k in range(lo, start):
                    slot = table[k // ps] * ps + k % ps
                    want = (adapter, tuple(seq[: k + 1]))
                    have = self.kv[g].get(slot)
                    if have != want:
                        raise KVMismatch(
                            f"rid {req.rid} group {g}: key {k} (page {table[k // ps]}) holds "
                            f"{'nothing' if have is None else 'another sequence'}"
                        )
                    check.seen.append((g, slot, want))
                    self.reads += 1
                for k in range(start, start + row.length):
                    slot = table[k // ps] * ps + k % ps
                    label = (adapter, tuple(seq[: k + 1]))
                    self.kv[g][slot] = label
                    check.seen.append((g, slot, label))
            next_tokens.append(self.next_token(adapter, seq[: start + row.length]))
        tokens = torch.tensor(next_tokens, dtype=torch.int64)
        prompt = None
        if batch.prompt_logprobs is not None:  # values do not matter here, only that they come back
            prompt = PromptLogprobs(torch.zeros(batch.prompt_logprobs.token_index.shape[0]), None, None)
        done = _Processed(self, check)
        return ForwardOutput(tokens, tokens.clone(), None, None, None, done, prompt)  # type: ignore[arg-type]

    def recheck(self, check: _Check) -> None:
        for g, slot, label in check.seen:
            if self.kv[g].get(slot) != label:
                raise KVMismatch(
                    f"group {g} slot {slot} was overwritten while a batch reading it was in flight"
                )

    def step_logits(self, batch: ForwardBatch):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def sample(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def next_token(self, adapter: int, seq: list[int]) -> int:
        """The "model": a hash of the adapter and the whole sequence, never one of the ids below 3."""
        digest = hashlib.blake2b(repr((adapter, seq)).encode(), digest_size=4).digest()
        return 3 + int.from_bytes(digest, "little") % (self.vocab - 3)

    def expected(self, adapter: int, prompt: list[int], max_tokens: int) -> list[int]:
        """The tokens a request generates: the same hash, over the sequence as it grows."""
        seq = list(prompt)
        for _ in range(max_tokens):
            seq.append(self.next_token(adapter, seq))
        return seq[len(prompt) :]


class _NoWeights:
    """An adapter loader with nothing to read or load: adapters here only key the labels."""

    @dataclass(frozen=True)
    class Weights:
        nbytes: int = 1

    def read(self, path: str) -> Weights:
        return self.Weights()

    def load(self, slot: int, adapter: object) -> None:
        return None


class OracleRun:
    """A real `Scheduler` and `KVManager` over a `LabelEngine`, stepped by hand."""

    def __init__(
        self,
        groups: list[GroupInfo],
        page_size: int,
        *,
        prefix_cache: bool = True,
        chunk_size: int = 16,
        max_running: int = 4,
        overlap: bool = True,
        max_seq_len: int = 4096,
        max_loras: int = 0,
    ) -> None:
        self.kv = KVManager(groups, page_size, prefix_cache=prefix_cache, chunk_size=chunk_size)
        self.engine = LabelEngine([g.window for g in groups], page_size)
        config = SchedulerConfig(
            max_running=max_running,
            chunk_size=chunk_size,
            max_seq_len=max_seq_len,
            prefix_cache=self.kv.caching,
            overlap=overlap,
            guard_inflight_pages=True,
        )
        self.outputs: list[TokenOutput] = []
        streams = StreamSet(torch.device("cpu"))
        self.streams = streams
        lora = AdapterSlots(_NoWeights(), max_loras, 2 * max_loras) if max_loras else None
        self.scheduler = Scheduler(config, self.engine, self.kv, streams, (), self.outputs.extend, lora=lora)
        launch = self.scheduler.launcher.launch

        def launch_with_rows(prepared: PreparedBatch, defer_masks: bool = False) -> InFlight:
            self.engine.rows = prepared.rows
            return launch(prepared, defer_masks)

        self.scheduler.launcher.launch = launch_with_rows  # type: ignore[method-assign]
        self.overlap = overlap
        self._last: InFlight | None = None
        self.inbox: list[SchedulerMsg] = []

    def step(self) -> None:
        def receive(blocking: bool) -> list[SchedulerMsg]:
            msgs, self.inbox[:] = list(self.inbox), []
            return msgs

        with self.streams.use(self.streams.scheduler), torch.inference_mode():
            if self.overlap:
                self._last = self.scheduler.overlap_step(receive, self._last)
            else:
                self.scheduler.normal_step(receive)

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work or self._last is not None or bool(self.inbox)

    def run(self, until: Callable[[], bool] | None = None, limit: int = 100_000) -> None:
        for _ in range(limit):
            if (until is not None and until()) or (until is None and not self.busy):
                return
            self.step()
        raise AssertionError("the run did not finish")


def check_pages(run: OracleRun) -> None:
    """Page accounting between steps: with the window tree, every page of every group is exactly one of
    free, pending release, the tree's, or held by a live request (its own, past its cached prefix); the
    tree's evictable counts are what its nodes say; reservations add up; and free plus evictable pages
    cover every reservation, so no running request can find the pool empty."""
    kv = run.kv
    live = [r for r in run.scheduler.running.values() if not r.released and r.pages]
    tree = kv.window_cache
    for g, alloc in enumerate(kv.allocators):
        assert kv.outstanding[g] == sum(r.reserved[g] for r in live)
        if tree is None:
            evictable = kv.cache.evictable_pages if kv.cache is not None else 0
            assert alloc.num_free + evictable >= kv.outstanding[g]
            continue
        assert kv.windows is not None
        nodes = tree.nodes()
        free = [p for p in range(alloc.num_pages) if alloc._is_free[p]]
        pending = [p for item in kv.pending if item.group == g for p in item.pages]
        cached = [p for n in nodes for p in n.pages[g]]
        held = [
            p
            for r in live
            for i, p in enumerate(r.pages[g])
            if i >= r.cached_prefix // kv.page_size and kv.windows._held(r, g, i)
        ]
        everything = free + pending + cached + held
        assert len(everything) == len(set(everything)) == alloc.num_pages, f"group {g}: pages lost or shared"
        if kv.groups[g].window is None:
            evictable = sum(len(n.pages[g]) for n in nodes if n.lock_ref == 0)
        else:
            evictable = sum(len(n.pages[g]) for n in nodes if n.live and n.win_lock_ref == 0)
        assert tree.evictable_pages(g) == evictable
        assert alloc.num_free + evictable >= kv.outstanding[g]
    for n in tree.nodes() if tree is not None else []:
        assert n.lock_ref >= n.win_lock_ref >= 0 and (n.live or n.win_lock_ref == 0)
