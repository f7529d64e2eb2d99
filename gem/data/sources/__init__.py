"""Data sources: where examples come from, and the one entry point :func:`build_source`.

Each source module has ``open_source(data_cfg, is_writer) -> DataSource``; :data:`SOURCES` maps
``data.kind`` to it. Adding a source is one module with that function plus one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gem.data.errors import DataError
from gem.data.sources import parquet, seqrec, stream, synthetic
from gem.data.sources.base import DataSource, dataset_schema

SOURCES: dict[str, Callable[[Any, bool], DataSource]] = {
    "synthetic": synthetic.open_source,  # generated into data.cache_dir on first use
    "parquet": parquet.open_source,  # data.dir already in the gem layout
    "seqrec": seqrec.open_source,  # a public sequential-recommendation set, converted once
    "stream": stream.open_source,  # time-ordered day=YYYY-MM-DD/ partitions, one pass (or a synthetic stream)
}


def build_source(data_cfg: Any, *, is_writer: bool = True) -> DataSource:
    """The data source ``data_cfg.kind`` names, prepared and ready to read.

    Args:
        data_cfg: the ``data`` config (gem.train.config.DataConfig: kind, dir, name, cache_dir, schema, ...).
        is_writer: this process may write the data set (rank 0); the others wait for it.
    """
    open_source = SOURCES.get(data_cfg.kind)
    if open_source is None:
        raise DataError(f"data.kind={data_cfg.kind!r} is not a data source; use one of {sorted(SOURCES)}")
    return open_source(data_cfg, is_writer)


__all__ = ["SOURCES", "DataSource", "build_source", "dataset_schema"]
