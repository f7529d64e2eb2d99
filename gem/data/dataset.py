"""Find (or, for synthetic data, create) a data set and open readers over its splits."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

import pyarrow.parquet as pq

from gem.data.parquet import list_parquet_files
from gem.data.schema import FeatureSchema
from gem.data.synthetic import SyntheticConfig, write_dataset

SPLITS = ("train", "val", "test")


def synthetic_dir(cache_dir: str, name: str, schema: FeatureSchema, num_examples: Mapping[str, int],
                  seed: int, knobs: Mapping[str, Any]) -> Path:
    """The cache folder of a synthetic data set: its name plus a hash of everything that shapes it."""
    key = json.dumps({"schema": schema.to_config(), "n": dict(num_examples), "seed": seed, "knobs": dict(knobs)}, sort_keys=True)
    return Path(cache_dir) / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def prepare_synthetic(cache_dir: str, name: str, schema: FeatureSchema, num_examples: Mapping[str, int], seed: int,
                      knobs: Mapping[str, Any], is_writer: bool = True) -> Path:
    """Return the synthetic data set's folder, generating it first if absent.

    Only ``is_writer`` (rank 0) generates; other ranks wait for the folder to appear.
    """
    try:
        cfg = SyntheticConfig(**knobs)
    except TypeError as e:
        raise ValueError(f"data.synthetic: {e}; known knobs: {list(SyntheticConfig.__dataclass_fields__)}") from None
    directory = synthetic_dir(cache_dir, name, schema, num_examples, seed, knobs)
    if not directory.exists():
        if is_writer:
            write_dataset(directory, schema, dict(num_examples), seed, cfg)
        else:
            wait_for_folder(directory, 600, "generate")
    return directory


def wait_for_folder(directory: Path, timeout_s: float, what: str) -> None:
    """Block a non-writer rank until rank 0's data set folder appears (written atomically)."""
    deadline = time.monotonic() + timeout_s
    while not directory.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s / 60:.0f} min for rank 0 to {what} {directory}")
        time.sleep(0.5)


def split_files(directory: str | os.PathLike, split: str) -> list[Path]:
    return list_parquet_files(Path(directory) / split)


def schema_from_files(files: list[Path]) -> FeatureSchema:
    """The schema written into a gem Parquet file's metadata."""
    meta = pq.ParquetFile(files[0]).schema_arrow.metadata or {}
    if b"gem.schema" not in meta:
        raise ValueError(f"{files[0]}: no gem.schema in the file metadata; give the schema in config (data.schema)")
    return FeatureSchema.from_config(json.loads(meta[b"gem.schema"]))
