"""A data set already in the gem Parquet layout, at ``data.dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gem.data.sources.base import DataSource


def open_source(data_cfg: Any, is_writer: bool = True) -> DataSource:
    """``data.dir`` with its ``train/``, ``val/`` and ``test/`` folders (nothing to prepare)."""
    if not data_cfg.dir:
        raise ValueError(
            "data.dir is required when data.kind=parquet; set data.dir=/path/to/dataset (with train/ val/ test/)"
        )
    return DataSource.from_folder(data_cfg, Path(data_cfg.dir))
