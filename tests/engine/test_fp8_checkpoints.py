"""FP8 checkpoints on CPU: the hub's two formats (transformers' block-scaled `fp8`, compressed-tensors
`float-quantized` per channel and per tensor, with an `ignore` list) and dynamic `quantization="fp8"`,
built from a tiny random model at test time. On CPU the FP8 weights are dequantized to float32 and
activations stay unquantized, so greedy tokens must equal HF transformers' on the dequantized weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.engine_config import resolve_engine_config
from tandem.engine.layers.source import InMemorySource
from tandem.engine.quant.fp8_export import dequantized, write_fp8_checkpoint
from tandem.engine.quant.fp8_format import DequantSource, Fp8Checkpoint, quantize_per_channel

PROMPT_LENS = [3, 13, 40, 7]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.mark.parametrize(
    ("family", "layout", "ignore"),
    [
        ("qwen3", "block", ()),  # 24 x 24 blocks: edge blocks and blocks across merged q/k/v rows
        ("llama", "channel", ("model.layers.0.mlp.down_proj",)),  # one layer left in the ignore list
        ("qwen2", "tensor", ()),  # per-tensor scales on q, k and v merge into one layer
    ],
)
def test_fp8_checkpoint_matches_hf_on_the_dequantized_weights(
    family: str, layout: str, ignore: tuple[str, ...], tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_model_dir(family)
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    write_fp8_checkpoint(src, fp8_dir, ref_dir, layout=layout, block=(24, 24), ignore=ignore)  # type: ignore[arg-type]
    quant = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == ("fp8" if layout == "block" else "compressed-tensors")
    assert resolve_engine_config(fp8_dir, device="cpu").quantization == "fp8"
    llm = LLM(str(fp8_dir), device="cpu")
    prompts = _prompts(llm.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == _hf_greedy(ref_dir, prompts)
    # The FP8 weights really differ from the source's: the test would pass vacuously otherwise.
    plain = LLM(str(src), device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs] or layout == "block"


def test_dynamic_fp8_matches_hf_on_round_tripped_weights(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """`quantization="fp8"` on CPU: every projection rounded through per-channel FP8 and back."""
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("qwen3")
    ref_dir = tmp_path / "ref"
    write_fp8_checkpoint(src, tmp_path / "unused", ref_dir, layout="channel")
    weights = load_file(str(src / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            weights[name] = (lambda q: q[0].float() * q[1][:, None])(quantize_per_channel(w))
    save_file(weights, str(ref_dir / "model.safetensors"))
    llm = LLM(str(src), device="cpu", quantization="fp8")
    assert llm.runtime.engine.config.quantization == "fp8"
    prompts = _prompts(llm.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == _hf_greedy(ref_dir, prompts)


@pytest.mark.parametrize(
    ("dim", "start", "size"), [(0, 0, 50), (0, 17, 40), (1, 0, 33), (1, 30, 20), (0, 48, 22)]
)
@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_a_shard_reads_the_scales_of_its_own_rows_and_columns(
    layout: str, dim: int, start: int, size: int
) -> None:
    """What a TP rank reads (rows of a column-parallel layer, columns of a row-parallel one), at offsets
    that cut through scale blocks, equals the same slice of the whole dequantized weight."""
    from tandem.engine.quant.fp8_export import _quantize

    weight = torch.randn(70, 50, generator=torch.Generator().manual_seed(1)) * 0.05
    wq, scale = _quantize(weight, layout, (16, 16))  # type: ignore[arg-type]
    whole = dequantized(wq, scale, layout, (16, 16))  # type: ignore[arg-type]
    source = DequantSource(
        InMemorySource("w", wq), InMemorySource("s", scale), (16, 16) if layout == "block" else None
    )
    size = min(size, weight.shape[dim] - start)
    assert torch.equal(source.read(dim, start, size), whole.narrow(dim, start, size))
    assert float((whole - weight).abs().max()) < 0.1 * float(weight.abs().max())  # FP8, not garbage


def test_unsupported_quantizations_fail_by_name() -> None:
    with pytest.raises(ValueError, match="awq"):
        Fp8Checkpoint.from_config({"quant_method": "awq"})
    with pytest.raises(ValueError, match="pack-quantized"):
        Fp8Checkpoint.from_config({"quant_method": "compressed-tensors", "format": "pack-quantized"})
    with pytest.raises(ValueError, match="static"):
        Fp8Checkpoint.from_config({"quant_method": "fp8", "activation_scheme": "static"})
    assert Fp8Checkpoint.from_config(None) is None
