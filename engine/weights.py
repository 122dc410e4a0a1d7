"""Load a model's weights from safetensors, one slice at a time, for this rank only."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

from safetensors import safe_open

from tandem.engine.layers.source import SafetensorsSource
from tandem.engine.models.common import CausalLM

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


def iter_sources(files: list[Path]) -> Iterator[SafetensorsSource]:
    with ExitStack() as stack:
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield SafetensorsSource(name, handle)


def load_weights(
    model: CausalLM, model_dir: Path, progress: Callable[[int, int], None] | None = None
) -> None:
    """Fill every parameter of `model`; a missing or mis-shaped tensor raises, naming it."""
    loaders = model.loaders()
    loaded: set[str] = set()
    files = safetensors_files(model_dir)
    for i, source in enumerate(iter_sources(files)):
        name = source.name
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name not in loaders:
            raise ValueError(
                f"checkpoint tensor {name!r} does not belong to {model.config.architecture}; "
                "is config.json the right one for these weights?"
            )
        module, shard_id, is_bias = loaders[name]
        module.load(source, shard_id, is_bias=is_bias)
        loaded.add(name)
        if progress is not None:
            progress(i + 1, len(loaders))
    missing = [n for n in loaders if n not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {model_dir} is missing {len(missing)} tensor(s): {shown}")
