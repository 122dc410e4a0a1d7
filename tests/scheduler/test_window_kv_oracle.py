"""The prefix caches under random traffic, the real scheduler and KV manager over a stand-in engine that
checks every key each batch reads (kv_oracle.py): shared prefixes, multi-turn extensions and repeats,
arriving while others decode; LoRA adapters, prompt log-probs, stop tokens, a context limit and aborts;
windows of 2 to 16 tokens over pages of 1 to 4 (multiples or not), window pools from 8 pages, overlap on
and off, Mistral's one window group, and a model without windows (the plain tree).

Each batch must read its own sequence's KV in every key of every group (a hit on tombstoned or
another sequence's window KV fails), nothing a batch read may be overwritten before it is processed
(the deferred-release rule, the tree's own evictions included), no in-flight page is handed out (the
guard), and between steps every page is free, pending, cached or held exactly once with reservations
covered by free and evictable pages. At the end nothing is held, pending, locked or leaked."""

from __future__ import annotations

import random

import pytest

from tandem.scheduler.kv_manager import GroupInfo
from tandem.scheduler.messages import AbortRequest, AddRequest, LoRARequest, SamplingSpec
from tandem.scheduler.windows import nodes, prefix, tree

from .kv_oracle import KVMismatch, OracleRun, check_pages

VOCAB = 50


def _groups(rng: random.Random, kind: str) -> tuple[list[GroupInfo], int]:
    window = rng.choice([2, 3, 5, 8, 9, 16])
    full = GroupInfo(0, None, rng.choice([30, 40, 80, 200]))
    if kind == "full":
        return [full], window
    windowed = GroupInfo(1 if kind == "hybrid" else 0, window, rng.choice([8, 10, 12, 16, 20, 40, 80]))
    return ([full, windowed] if kind == "hybrid" else [windowed]), window


def run_traffic(seed: int, kind: str) -> int:
    """One random run; returns the prefix cache's hit tokens."""
    rng = random.Random(seed)
    groups, _ = _groups(rng, kind)
    max_seq = rng.choice([4096, 60])
    run = OracleRun(
        groups,
        rng.choice([1, 2, 3, 4]),
        prefix_cache=rng.random() < 0.9,
        chunk_size=rng.choice([3, 4, 8, 16]),
        max_running=rng.choice([1, 2, 4, 6]),
        overlap=rng.random() < 0.7,
        max_seq_len=max_seq,
        max_loras=2,
    )
    stems = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    stop = rng.choice([(), (), (7,), (7, 11, 13)])
    sent: dict[int, tuple[list[int], int, int]] = {}  # rid -> (prompt, max_tokens, adapter)
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    histories: list[list[int]] = []

    def add() -> None:
        if histories and rng.random() < 0.4:  # the next turn of a finished conversation
            prompt = rng.choice(histories) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(10))]
        else:
            tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(12))]
            prompt = rng.choice(stems)[: rng.randrange(1, 40)] + tail or [5]
        max_tokens = rng.randrange(1, 20)
        total = min(len(prompt) + max_tokens, max_seq)
        if len(prompt) >= max_seq or run.kv.never_fits(len(prompt), total) is not None:
            return
        rid, adapter = len(sent), rng.choice([0, 0, 0, 1, 2])
        lora = LoRARequest(f"adapter{adapter}", adapter, "/nowhere") if adapter else None
        logprobs = 0 if rng.random() < 0.1 else None
        spec = SamplingSpec(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=stop,
            prompt_logprobs=logprobs,
        )
        run.inbox.append(AddRequest(rid, prompt, spec, lora=lora))
        sent[rid], tokens[rid] = (prompt, max_tokens, adapter), []

    for _ in range(rng.randrange(1, 6)):
        add()
    arrivals = rng.randrange(5, 40)
    for _ in range(20_000):
        if not run.busy and arrivals == 0:
            break
        if arrivals and rng.random() < 0.3:
            add()
            arrivals -= 1
        run.step()
        check_pages(run)
        for out in run.outputs:
            if out.token_id is not None:
                tokens[out.rid].append(out.token_id)
            if out.finish_reason is not None:
                finished[out.rid] = out.finish_reason
                if out.finish_reason != "abort":
                    histories.append(sent[out.rid][0] + tokens[out.rid])
        run.outputs.clear()
        running = [rid for rid in tokens if rid not in finished]
        if running and rng.random() < 0.04:
            run.inbox.append(AbortRequest(rng.choice(running)))
    else:
        raise AssertionError("the run did not finish")
    for rid, (prompt, max_tokens, adapter) in sent.items():
        out = tokens[rid]
        assert out == run.engine.expected(adapter, prompt, max_tokens)[: len(out)]
        if finished[rid] != "abort":
            assert len(out) == max_tokens or out[-1] in stop or len(prompt) + len(out) >= max_seq
    _assert_all_returned(run)
    return int(run.kv.stats()["prefix_cache_hit_tokens"])


def _assert_all_returned(run: OracleRun) -> None:
    stats = run.kv.stats()
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_pending"] == 0
    assert run.kv.outstanding == [0] * len(run.kv.groups)
    cache = run.kv.window_cache
    if cache is not None:
        assert all(n.lock_ref == 0 for n in cache.nodes())
        for g in range(len(run.kv.groups)):  # everything cached can be evicted: nothing stays pinned
            cache.evict(g, 1 << 30)
        assert cache.nodes() == []
    elif run.kv.cache is not None:
        run.kv.cache.evict(1 << 30)
    assert [a.num_free for a in run.kv.allocators] == [g.num_pages for g in run.kv.groups]


@pytest.mark.parametrize("kind", ["hybrid", "mistral", "full"])
def test_random_traffic_reads_only_its_own_kv_and_returns_every_page(kind: str) -> None:
    hits = [run_traffic(seed, kind) for seed in range(24)]
    assert sum(h > 0 for h in hits) >= 8  # the caches were really used


@pytest.mark.parametrize("seed", [31, 57])
def test_the_oracle_catches_a_match_one_key_short_of_its_window(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Runs of the same traffic with the window arithmetic off by one (a hit needs, and a lock pins, window
    KV from one key later than a query reads): a batch reads a key whose window KV the tree no longer has
    (the stand-in page of a hit)."""

    def one_short(end_pages: int, page_size: int, window: int) -> int:
        return max(0, end_pages * page_size - window + 2) // page_size

    for module in (nodes, tree, prefix):
        monkeypatch.setattr(module, "first_window_page", one_short)
    with pytest.raises(KVMismatch, match="holds another sequence"):
        run_traffic(seed, "hybrid")
