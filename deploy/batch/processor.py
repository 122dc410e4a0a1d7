"""`build_processor(config, preprocess, postprocess)`: a `Dataset -> Dataset` transform, as in
`ray.data.llm`: preprocess (a row in, its request fields out), the engine stage, postprocess.

Every column a row had stays until postprocess, next to what preprocess added and the generated columns
(`rows.OUTPUT_SCHEMA`). Postprocess sees every row, failed ones too, and its output always keeps the
`error` column, so a failed row can never pass for a good one. Like every Ray Data transform it is lazy:
the work runs, with Ray Data's progress bars, when the dataset is consumed or written.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from ray.data import Dataset

from tandem.cluster.ray_cluster import ensure_ray
from tandem.deploy.batch.actor_group import release_orphan_groups
from tandem.deploy.batch.actor_pool import engine_spec, local_cluster_cpus, map_batches_kwargs
from tandem.deploy.batch.config import ProcessorConfig
from tandem.deploy.batch.row_stage import RowStage

Row = dict[str, Any]
RowFn = Callable[[Row], Row]


class Processor:
    def __init__(
        self,
        config: ProcessorConfig,
        preprocess: RowFn | None = None,
        postprocess: RowFn | None = None,
        preprocess_map_kwargs: dict[str, Any] | None = None,
        postprocess_map_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.preprocess_map_kwargs = dict(preprocess_map_kwargs or {})
        self.postprocess_map_kwargs = dict(postprocess_map_kwargs or {})

    def __call__(self, dataset: Dataset) -> Dataset:
        # The device and the placement depend on the cluster; one started here fits the pool.
        ensure_ray(num_cpus=local_cluster_cpus(self.config))
        release_orphan_groups()
        spec = engine_spec(self.config)
        if self.preprocess is not None:
            dataset = dataset.map(partial(_preprocessed, self.preprocess), **self.preprocess_map_kwargs)
        # Blocks of one batch each, so batches spread over the actors however large the input's blocks.
        dataset = dataset.repartition(target_num_rows_per_block=self.config.batch_size)
        dataset = dataset.map_batches(RowStage, **map_batches_kwargs(self.config, spec))
        if self.postprocess is not None:
            dataset = dataset.map(partial(_postprocessed, self.postprocess), **self.postprocess_map_kwargs)
        return dataset


def build_processor(
    config: ProcessorConfig,
    preprocess: RowFn | None = None,
    postprocess: RowFn | None = None,
    preprocess_map_kwargs: dict[str, Any] | None = None,
    postprocess_map_kwargs: dict[str, Any] | None = None,
) -> Processor:
    """A processor running `config`'s model; `preprocess` and `postprocess` are row functions.

    With no Ray running yet it starts one here, with the logical CPUs the pool reserves, before the
    dataset is built (`ray.data.from_items` would start one of the machine's cores alone)."""
    ensure_ray(num_cpus=local_cluster_cpus(config))
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


def _preprocessed(preprocess: RowFn, row: Row) -> Row:
    return {**row, **preprocess(row)}


def _postprocessed(postprocess: RowFn, row: Row) -> Row:
    out = postprocess(row)
    if "error" not in out:
        out = {**out, "error": row["error"]}
    return out
