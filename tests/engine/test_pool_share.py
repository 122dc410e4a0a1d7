"""A draft model's share of the target's KV budget (engine/pool_share.py): its KV elements a token are
what its built engine's pool takes, its weights bound from above, and the target's page count leaves
room for both."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.engine.distributed import TPGroup
from tandem.engine.engine import Engine
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.pool_share import MIN_PAGES, PoolShare, kv_pages
from tandem.engine.streams import StreamSet

GIB = 2**30


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_drafts_share_matches_its_built_engine(family: str, tiny_model_dir: Callable[..., Path]) -> None:
    model_dir = tiny_model_dir(family)
    config = resolve_engine_config(model_dir, device="cpu", dtype="float32", num_pages=8)
    engine = Engine(config, TPGroup(), StreamSet(torch.device("cpu")))
    params = sum(p.numel() for p in engine.model.parameters())
    for dummy in (False, True):
        share = PoolShare.of_model(model_dir, 1, torch.float32, dummy)
        assert share.kv_elements_per_token * 4 == engine.model.kv_bytes_per_token(4)
        # From above (files hold headers; the count has every tensor the engine builds), and close.
        assert params * 4 <= share.reserved_bytes <= params * 4 * 1.05 + 2**16


def test_kv_heads_split_over_ranks_keep_at_least_one(tiny_model_dir: Callable[..., Path]) -> None:
    model_dir = tiny_model_dir("qwen3")
    one = PoolShare.of_model(model_dir, 1, torch.bfloat16, True).kv_elements_per_token
    two = PoolShare.of_model(model_dir, 2, torch.bfloat16, True).kv_elements_per_token
    many = PoolShare.of_model(model_dir, 64, torch.bfloat16, True).kv_elements_per_token
    heads = int(json.loads((model_dir / "config.json").read_text())["num_key_value_heads"])
    assert two * 2 == one and many * heads == one


def test_the_target_leaves_room_for_the_drafts_weights_and_pages() -> None:
    free, total, fraction, page, token_bytes, elem = 100 * GIB, 140 * GIB, 0.85, 16, 128 * 1024, 2
    alone = kv_pages(free, total, fraction, page, token_bytes, elem, None)
    share = PoolShare(reserved_bytes=2 * GIB, kv_elements_per_token=28 * 1024)
    pages = kv_pages(free, total, fraction, page, token_bytes, elem, share)
    budget = free - (1 - fraction) * total
    both = (pages + 1) * page * (token_bytes + share.kv_elements_per_token * elem) + share.reserved_bytes
    assert pages < alone and both <= budget
    assert both + page * (token_bytes + share.kv_elements_per_token * elem) > budget  # none left unused
    assert alone == int(budget // (page * token_bytes)) - 1


def test_no_room_for_the_draft_is_an_error_that_says_so() -> None:
    share = PoolShare(reserved_bytes=30 * GIB, kv_elements_per_token=1024)
    with pytest.raises(RuntimeError, match=r"reserving 30\.00 GiB for the draft's weights"):
        kv_pages(40 * GIB, 80 * GIB, 0.85, 16, 1024, 2, share)
    assert kv_pages(40 * GIB, 80 * GIB, 0.85, 16, 1024, 2, None) > MIN_PAGES
