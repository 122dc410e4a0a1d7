"""Resident MXFP4 experts (the 4-bit layout the Triton kernels read on CUDA), checked on CPU: loading
the hub's bytes into it (de-interleaved gate/up rows, TP slices of down's 32-value blocks, EP's whole
experts) holds exactly the values the dequantizing load holds; a split that would cut a block fails,
naming the fix; a whole tiny gpt-oss held that way (its torch path dequantizes per expert) gives HF's
greedy tokens on the dequantized weights; `load_format="dummy"` draws the packed layout."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.layers.source import InMemorySource
from tandem.engine.moe.experts import FUSED_DOWN, FUSED_GATE_UP, MoEExperts
from tandem.engine.moe.spec import ExpertShard, MoESpec
from tandem.engine.quant.mxfp4 import Mxfp4Checkpoint, Mxfp4Source

from .test_mxfp4 import write_mxfp4

GPT_OSS = {
    "scoring": "topk_softmax",
    "router_bias": True,
    "expert_bias": True,
    "activation": "swiglu_clamped",
    "gpt_oss_layout": True,
}


def _sources(e: int, h: int, i: int) -> tuple[Mxfp4Source, Mxfp4Source]:
    g = torch.Generator().manual_seed(0)

    def pair(name: str, rows: int, cols: int) -> Mxfp4Source:
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        return Mxfp4Source(InMemorySource(f"{name}_blocks", blocks), InMemorySource(f"{name}_scales", scales))

    return pair("gate_up_proj", 2 * i, h), pair("down_proj", h, i)


@pytest.mark.parametrize(("rank", "size", "ep"), [(0, 1, False), (0, 2, False), (1, 2, False), (1, 2, True)])
def test_packed_load_holds_the_dequantized_values(rank: int, size: int, ep: bool) -> None:
    e, h, i = 4, 64, 128
    spec = MoESpec(e, 2, i, False, (True,), **GPT_OSS)  # type: ignore[arg-type]
    shard = ExpertShard.of(spec, rank, size, expert_parallel=ep)
    gate_up, down = _sources(e, h, i)
    held = {}
    for mxfp4 in (False, True):
        m = MoEExperts(spec, shard, h, dtype=torch.float32, device=torch.device("cpu"), mxfp4=mxfp4)
        m.load(gate_up, FUSED_GATE_UP, is_bias=False)
        m.load(down, FUSED_DOWN, is_bias=False)
        held[mxfp4] = m
    assert held[True].w13.dtype == torch.uint8 and held[True].w13.shape[-1] == h // 2
    for local in range(shard.num_local):
        packed13, packed2 = held[True].expert_weights(local)
        assert torch.equal(packed13, held[False].w13[local]) and torch.equal(packed2, held[False].w2[local])
    assert held[False].w13.abs().sum() > 0


def test_a_split_that_cuts_a_block_is_named() -> None:
    spec = MoESpec(4, 2, 96, False, (True,), **GPT_OSS)  # type: ignore[arg-type]
    shard = ExpertShard.of(spec, 1, 2, expert_parallel=False)  # rows [48, 96)
    with pytest.raises(ValueError, match=r"rows \[48, 96\) .* cut its 32-value blocks"):
        MoEExperts(spec, shard, 64, dtype=torch.float32, device=torch.device("cpu"), mxfp4=True)


@pytest.fixture
def resident(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine chooses on CUDA with Triton, chosen on CPU."""
    monkeypatch.setattr(Mxfp4Checkpoint, "resident", staticmethod(lambda device, *, triton: True))


@pytest.mark.usefixtures("resident")
def test_a_resident_tiny_gpt_oss_matches_hf(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    write_mxfp4(tiny_model_dir("gpt_oss"), tmp_path / "dense", tmp_path / "mxfp4")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 7)]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", attn_implementation="eager").eval()
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    dense_bytes = sum(p.nbytes for p in hf.parameters())
    llm = LLM(str(tmp_path / "mxfp4"), device="cpu", chunk_size=16)
    try:
        engine = llm.runtime.engine
        experts = [m for m in engine.model.modules() if isinstance(m, MoEExperts)]
        assert engine.mxfp4_experts and experts and all(m.w13.dtype == torch.uint8 for m in experts)
        assert engine.weight_bytes < dense_bytes  # the experts counted at their packed size
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("resident")
def test_dummy_weights_draw_the_packed_layout(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir("gpt_oss"), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), device="cpu", load_format="dummy")
    try:
        experts = [m for m in llm.runtime.engine.model.modules() if isinstance(m, MoEExperts)]
        for m in experts:
            w13, w2 = m.expert_weights(0)
            # Near N(0, 1 / fan_in), within the nearest power of two's factor.
            for w, fan_in in ((w13, w13.shape[1]), (w2, w2.shape[1])):
                assert 0.5 < float(w.float().std()) * fan_in**0.5 < 2.0
            assert m.w13.unique().numel() > 200  # random bytes, not a constant
        out = llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        assert len(out[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_the_experts_stay_packed_only_on_cuda_with_triton() -> None:
    assert Mxfp4Checkpoint.resident(torch.device("cuda"), triton=True)
    assert not Mxfp4Checkpoint.resident(torch.device("cuda"), triton=False)
    assert not Mxfp4Checkpoint.resident(torch.device("cpu"), triton=True)
