"""gem.data.sources: build_source turns the data config into a schema and loaders, one way for every kind."""

import dataclasses

import pytest

from gem.data import DataError, build_source
from gem.data.sources import SOURCES, DataSource
from gem.data.sources.synthetic import synthetic_dir
from gem.train.config import DataConfig
from tests.conftest import TINY_SCHEMA


def _data(**kw) -> DataConfig:
    return dataclasses.replace(DataConfig(schema=dict(TINY_SCHEMA)), **kw)


def test_synthetic_is_generated_once_into_the_cache(tmp_path):
    d = _data(cache_dir=str(tmp_path), num_examples={"train": 40, "val": 8, "test": 8})
    source = build_source(d)
    assert source.kind == "synthetic" and source.dir.parent == tmp_path
    assert source.dir == synthetic_dir(d.cache_dir, d.name, source.schema, d.num_examples, d.seed, d.synthetic)
    assert source.schema.to_config()["tasks"] == TINY_SCHEMA["tasks"]
    assert build_source(d).dir == source.dir, "a second call reuses the folder"
    assert sum(b.batch_size for b in source.loader("train", 16)) == 40


def test_parquet_reads_the_schema_from_the_files_unless_given(tiny_dataset, tiny_schema):
    from_files = build_source(_data(kind="parquet", dir=str(tiny_dataset), schema={}))
    assert from_files.schema == tiny_schema and from_files.files("train") == sorted(
        (tiny_dataset / "train").glob("*.parquet")
    )
    given = build_source(_data(kind="parquet", dir=str(tiny_dataset)))
    assert given.schema == from_files.schema


def test_unknown_kinds_and_missing_dirs_name_the_key():
    with pytest.raises(
        DataError, match=r"data.kind='csv' is not a data source; use one of \[.*'parquet', 'seqrec'.*'synthetic'\]"
    ):
        build_source(_data(kind="csv"))
    with pytest.raises(ValueError, match="data.dir is required when data.kind=parquet"):
        build_source(_data(kind="parquet"))


def test_a_new_source_is_one_entry_in_the_registry(tiny_dataset, monkeypatch):
    seen = []

    def open_source(data_cfg, is_writer):
        seen.append(is_writer)
        return DataSource.from_folder(data_cfg, tiny_dataset)

    monkeypatch.setitem(SOURCES, "mine", open_source)
    source = build_source(_data(kind="mine"), is_writer=False)
    assert seen == [False] and source.kind == "mine" and source.dir == tiny_dataset
