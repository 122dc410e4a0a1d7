"""Find a model's files: a local HF-format directory, or a hub id downloaded into the HF cache."""

from __future__ import annotations

from pathlib import Path

_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def resolve_model_dir(model: str, *, revision: str | None = None, weights: bool = True) -> Path:
    """The model's local directory; a hub id is downloaded first (without its safetensors when
    `weights` is False: `load_format="dummy"` needs only the config and the tokenizer)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} is not a directory")
    from huggingface_hub import snapshot_download

    try:
        patterns = _PATTERNS if weights else [p for p in _PATTERNS if p != "*.safetensors"]
        return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
    except Exception as exc:
        raise FileNotFoundError(
            f"could not find model {model!r}: not a local directory, and the hub download failed ({exc})"
        ) from exc
