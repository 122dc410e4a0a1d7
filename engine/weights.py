"""Load a model's weights from safetensors, one slice at a time, for this rank only."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from safetensors import safe_open

from tandem.engine.config import ModelConfig
from tandem.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine.layers.source import SafetensorsSource, TensorSource
from tandem.engine.models.common import Loadable
from tandem.engine.moe.experts import MoEExperts
from tandem.engine.quant.fp8_format import KV_SCALE_SUFFIXES, SCALE_SUFFIXES, DequantSource, Fp8Checkpoint
from tandem.engine.quant.mxfp4 import Mxfp4Checkpoint

# Checkpoint entries that carry no weights of ours (recomputed buffers, a tied head's copy).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with index.open() as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


@contextlib.contextmanager
def open_sources(files: list[Path]) -> Iterator[dict[str, SafetensorsSource]]:
    """Every tensor of the checkpoint by name, lazily: a weight and its scale may sit in different files."""
    with ExitStack() as stack:
        sources: dict[str, SafetensorsSource] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                sources[name] = SafetensorsSource(name, handle)
        yield sources


class Checkpointed(Protocol):
    """What loading reads of a model: a CausalLM, or a drafter's head (engine/spec/head.py)."""

    @property
    def config(self) -> ModelConfig: ...

    def checkpoint_name(self, name: str) -> str: ...

    def ignores_checkpoint_tensor(self, name: str) -> bool: ...

    def loaders(self, available: Collection[str] = ()) -> dict[str, tuple[Loadable, int, bool]]: ...

    def linear_layers(self) -> list[ColumnParallelLinear | RowParallelLinear]: ...


@dataclass
class LoadReport:
    """What loading found beyond the weights: the GEMM layers whose checkpoint weights were FP8 (read
    dequantized; `quant.fp8_linear` quantizes them again on GPU), and per-layer KV-cache scales. A
    linear layer that runs no GEMM of its own (`CausalLM.linear_layers` leaves it out: latent
    attention's kv_b_proj, read as W_UK and W_UV) keeps its FP8 weight dequantized, in the compute
    dtype."""

    fp8_modules: list[ColumnParallelLinear | RowParallelLinear] = field(default_factory=list)
    kv_scales: dict[str, float] = field(default_factory=dict)  # "<layer prefix>.k_scale" -> value


def load_weights(
    model: Checkpointed,
    model_dir: Path,
    progress: Callable[[int, int], None] | None = None,
    fp8: Fp8Checkpoint | None = None,
    mxfp4: Mxfp4Checkpoint | None = None,
) -> LoadReport:
    """Fill every parameter of `model`; a missing or mis-shaped tensor raises, naming it. FP8 weights
    of `fp8` checkpoints are read dequantized to float32 and stored in the parameter's dtype; so are
    the MXFP4 blocks of `mxfp4` checkpoints (read under the dense tensor's name, with their scales)."""
    loaded: set[str] = set()
    report = LoadReport()
    files = safetensors_files(model_dir)
    with open_sources(files) as sources:
        dense = {name: mxfp4.weight_name(name) if mxfp4 else name for name in sources}
        ours = {name: model.checkpoint_name(dense[name]) for name in sources}
        loaders = model.loaders(set(ours.values()))
        gemm_layers = {id(m) for m in model.linear_layers()}
        for name, plain in sources.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if name.endswith(KV_SCALE_SUFFIXES):
                report.kv_scales[name] = float(plain.read().float().reshape(-1)[0])
                continue
            if fp8 is not None and name.endswith(SCALE_SUFFIXES):
                continue  # read with its weight
            if mxfp4 is not None and mxfp4.is_scales(name):
                continue  # read with its blocks
            if ours[name] not in loaders and model.ignores_checkpoint_tensor(ours[name]):
                continue
            if ours[name] not in loaders:
                raise ValueError(
                    f"checkpoint tensor {name!r} does not belong to {model.config.architecture}; "
                    "is config.json the right one for these weights?"
                )
            module, shard_id, is_bias = loaders[ours[name]]
            source: TensorSource = plain
            if mxfp4 is not None and mxfp4.is_blocks(name):
                if not isinstance(module, MoEExperts):
                    raise ValueError(
                        f"MXFP4 tensor {name!r} is not an MoE expert projection; tandem dequantizes "
                        "MXFP4 experts (gpt-oss's layout) only"
                    )
                source = mxfp4.source(plain, sources)
            scale = sources.get(fp8.scale_name(name)) if fp8 is not None and not is_bias else None
            if fp8 is not None and scale is not None:
                if isinstance(module, MoEExperts):
                    # Experts are read dequantized, or as FP8 where they stay FP8 (MoEExperts.load).
                    module.check_fp8_split(fp8.block, shard_id, name)
                elif not isinstance(module, ColumnParallelLinear | RowParallelLinear):
                    raise ValueError(
                        f"FP8 tensor {name!r} is neither a linear layer's nor an expert's weight; "
                        "tandem keeps it 16-bit"
                    )
                elif id(module) in gemm_layers and not any(m is module for m in report.fp8_modules):
                    report.fp8_modules.append(module)
                source = DequantSource(plain, scale, fp8.block)
            module.load(source, shard_id, is_bias=is_bias)
            loaded.add(ours[name])
            if progress is not None:  # counted in loaded tensors: scales and skipped names are not
                progress(len(loaded), len(loaders))
    missing = [n for n in loaders if n not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {model_dir} is missing {len(missing)} tensor(s): {shown}")
    return report
