"""A PEFT adapter directory from a local path or a URI: remote ones (anything fsspec reads: `s3://`,
`gs://`, `hf://`, `https://`..., with that filesystem's package installed; else smart_open) are copied once
into a local cache, since the ranks read adapters from local files."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Any

from tandem.engine.lora.peft_format import CONFIG_FILE, WEIGHTS_FILE


def is_uri(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def join(root: str, name: str) -> str:
    """`root/name`, for a local folder or a URI alike."""
    return f"{root.rstrip('/')}/{name}"


def local_dir(source: str, cache_root: Path) -> Path:
    """A local directory with the adapter's files: `source` itself when it is local (a path or file://),
    else its copy under `cache_root`, fetched on the first call. FileNotFoundError if it has no
    adapter_config.json; other OSErrors (and ImportError for a filesystem whose package is missing) as the
    filesystem raises them."""
    if not is_uri(source):
        return Path(source.removeprefix("file://")).expanduser()
    target = cache_root / hashlib.sha256(source.encode()).hexdigest()[:24]
    if (target / CONFIG_FILE).is_file() and (target / WEIGHTS_FILE).is_file():
        return target
    partial = cache_root / f".{target.name}.{uuid.uuid4().hex}"
    partial.mkdir(parents=True)
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            with _open(join(source, name)) as src, (partial / name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        try:
            os.replace(partial, target)
        except OSError:  # another request fetched it meanwhile
            if not (target / WEIGHTS_FILE).is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _open(uri: str) -> IO[Any]:
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri)
    except ValueError:  # a protocol fsspec does not know: smart_open may
        import smart_open

        return smart_open.open(uri, "rb")
    return fs.open(path, "rb")  # type: ignore[no-any-return]
