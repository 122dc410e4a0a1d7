"""`run_batch_file`: an OpenAI batch file through Ray Data, one engine per actor, into one output file.

Lines are read with Ray Data (a local path, or any URI it reads: s3://, gs://, ...), answered by
`LineStage` and written in input order, one output line per non-blank input line, by the driver as they
arrive, through the same filesystems. A local input path is read on this node, so the file need not
exist on the others.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa
import pyarrow.fs as pafs
import ray
from ray.data import DataContext, Dataset

from tandem.deploy.batch.actor_group import release_orphan_groups
from tandem.deploy.batch.actor_pool import engine_spec, map_batches_kwargs
from tandem.deploy.batch.config import ProcessorConfig
from tandem.deploy.batch.line_stage import LINE_COLUMN, STATUS_COLUMN, LineStage


@dataclass
class BatchFileSummary:
    lines: int = 0
    answered: int = 0  # a 200 response
    refused: int = 0  # a 4xx/5xx response: the API's error body
    invalid: int = 0  # not a request at all: an error object
    seconds: float = 0.0


def run_batch_file(
    input_uri: str, output_uri: str, config: ProcessorConfig, served_model_name: str | None = None
) -> BatchFileSummary:
    """Answer every line of `input_uri` into `output_uri`. Ray must be initialized."""
    release_orphan_groups()
    start = time.monotonic()
    spec = engine_spec(config)
    summary = BatchFileSummary()
    with _ordered():  # a dataset keeps the context it was built under
        dataset = read_lines(input_uri)
        dataset = dataset.repartition(target_num_rows_per_block=config.batch_size)
        kwargs = map_batches_kwargs(config, spec, served_model_name=served_model_name or config.model_source)
        dataset = dataset.map_batches(LineStage, **kwargs)
    with open_output(output_uri) as out:
        for block in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            batch = cast(pa.Table, block)
            lines = batch.column(LINE_COLUMN).to_pylist()
            out.write("".join(line + "\n" for line in lines).encode("utf-8"))
            for status in batch.column(STATUS_COLUMN).to_pylist():
                _count(summary, status)
    summary.seconds = time.monotonic() - start
    return summary


def _count(summary: BatchFileSummary, status: int | None) -> None:
    summary.lines += 1
    if status is None:
        summary.invalid += 1
    elif status == 200:
        summary.answered += 1
    else:
        summary.refused += 1


def readable_uri(uri: str) -> str:
    """The URI itself, or a scheme-less path made absolute, once it names a file here."""
    if "://" in uri:
        return uri
    path = os.path.abspath(os.path.expanduser(uri))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no input file {uri}")
    return path


def read_lines(uri: str) -> Dataset:
    """The file's non-blank lines (a `text` column). A local path is read on this node, which may be the
    only one that has the file."""
    path = readable_uri(uri)
    if "://" in uri:
        return ray.data.read_text(path)
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}  # every Ray node's own label
    return ray.data.read_text(path, label_selector=here)


@contextmanager
def open_output(uri: str) -> Iterator[Any]:
    """A binary output stream on the filesystem the URI names (pyarrow's, else fsspec's, as Ray Data
    resolves them); a local path's folder is created. A run that fails removes its partial output."""
    filesystem, path = _filesystem(uri)
    parent = os.path.dirname(path)
    if parent and isinstance(filesystem, pafs.LocalFileSystem):
        filesystem.create_dir(parent, recursive=True)
    stream = filesystem.open_output_stream(path)
    try:
        yield stream
    except BaseException:
        stream.close()
        with contextlib.suppress(OSError):
            filesystem.delete_file(path)
        raise
    stream.close()


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
        return filesystem, str(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        import fsspec

        filesystem, path = fsspec.core.url_to_fs(uri)
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), str(path)


@contextmanager
def _ordered() -> Iterator[None]:
    """Rows in input order for this run, so output line k answers input line k."""
    options = DataContext.get_current().execution_options
    saved = options.preserve_order
    options.preserve_order = True
    try:
        yield
    finally:
        options.preserve_order = saved
