import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem.data.format.dataset import schema_from_files, split_files
from gem.data.format.layout import write_parquet
from gem.data.pipeline.batch import Batch
from gem.data.pipeline.loader import build_loader
from gem.data.sources.synthetic import generate


def _read_all(files, schema, batch_size, **kw):
    """Every batch of ``files`` in file order (no balancing), as the one reader makes them."""
    return list(build_loader(files, schema, batch_size, options={"balance": False}, **kw))


def test_round_trip_keeps_every_value(tmp_path, tiny_schema):
    table = generate(tiny_schema, 203, seed=4)
    write_parquet(table, tmp_path / "a.parquet", tiny_schema)
    batches = _read_all([tmp_path / "a.parquet"], tiny_schema, 64)
    assert [b.batch_size for b in batches] == [64, 64, 64, 11]
    assert schema_from_files([tmp_path / "a.parquet"]) == tiny_schema
    for name in tiny_schema.id_feature_names:
        got = torch.cat([b.sparse[name].values() for b in batches]).numpy()
        assert np.array_equal(got, table[name].combine_chunks().flatten().to_numpy())
    for name in tiny_schema.sequence_feature_names:
        lengths = torch.cat([b.sequences[name].lengths() for b in batches]).numpy()
        assert np.array_equal(lengths, table[name].combine_chunks().value_lengths().to_numpy())
        got = torch.cat([b.sequences[name].values() for b in batches]).numpy()
        assert np.array_equal(got, table[name].combine_chunks().flatten().to_numpy())
    dense = torch.cat([b.dense for b in batches])
    assert dense.shape == (203, 3) and dense.dtype == torch.float32
    assert np.allclose(dense.numpy().ravel(), table["dense"].combine_chunks().flatten().to_numpy())
    labels = torch.cat([b.labels for b in batches])
    mask = torch.cat([b.label_mask for b in batches])
    assert np.array_equal(mask[:, 1].numpy(), table["label_mask_conversion"].to_numpy())
    assert np.array_equal(labels[:, 0].numpy(), table["label_click"].to_numpy())
    b = batches[0]
    assert b.max_seq_len["hist"] == int(b.sequences["hist_item"].lengths().max())


def test_shuffle_is_seeded_and_sharding_partitions(tiny_dataset, tiny_schema):
    files = split_files(tiny_dataset, "train")
    assert len(files) == 3  # 700 rows in files of 300
    plain = _read_all(files, tiny_schema, 50)
    a = _read_all(files, tiny_schema, 50, shuffle=True, seed=1)
    b = _read_all(files, tiny_schema, 50, shuffle=True, seed=1)
    assert all(torch.equal(x.dense, y.dense) for x, y in zip(a, b))
    assert not torch.equal(torch.cat([x.dense for x in a]), torch.cat([x.dense for x in plain]))
    key = lambda bs: sorted(map(tuple, torch.cat([x.dense for x in bs]).tolist()))  # noqa: E731
    assert key(a) == key(plain), "shuffling permutes, never drops or repeats"
    shards = [_read_all(files, tiny_schema, 50, rank=r, world_size=3) for r in range(3)]
    assert key([x for s in shards for x in s]) == key(plain), "ranks partition the batches"


def test_history_longer_than_max_keeps_most_recent(tmp_path, tiny_schema):
    table = generate(tiny_schema, 4, seed=0)
    long = pa.ListArray.from_arrays([0, 20, 20, 21, 36], pa.array(np.arange(36), pa.int64()))
    for name in tiny_schema.sequence_feature_names:  # ids 0..35, reduced into each feature's range
        card = tiny_schema.cardinality(name)
        ids = pa.ListArray.from_arrays(long.offsets, pa.array(np.arange(36) % card, pa.int64()))
        table = table.set_column(table.schema.get_field_index(name), name, ids)
    write_parquet(table, tmp_path / "x.parquet", tiny_schema)
    loader = build_loader([tmp_path / "x.parquet"], tiny_schema, 4)
    (batch,) = list(loader)
    jt = batch.sequences["hist_item"]
    assert jt.lengths().tolist() == [12, 0, 1, 12]
    assert jt.values().tolist() == list(range(8, 20)) + [20] + list(range(24, 36))
    assert loader.stats["truncated_histories"] == 2 and batch.max_seq_len["hist"] == 12


def test_batch_to_and_pin_memory(tiny_dataset, tiny_schema):
    batch = next(iter(build_loader(split_files(tiny_dataset, "val"), tiny_schema, 16)))
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.dense, batch.dense)
    assert moved.sequences.keys() == batch.sequences.keys() and moved.max_seq_len == batch.max_seq_len
    if torch.cuda.is_available():
        on_gpu = batch.pin_memory().to("cuda", non_blocking=True)
        assert on_gpu.dense.is_cuda and on_gpu.sparse.values().is_cuda and on_gpu.labels.is_cuda


def _write_with(tmp_path, tiny_schema, column, values):
    table = generate(tiny_schema, 6, seed=0)
    table = table.set_column(table.schema.get_field_index(column), column, values)
    write_parquet(table, tmp_path / "bad.parquet", tiny_schema)
    return [tmp_path / "bad.parquet"]


@pytest.mark.parametrize(
    "column, values, match",
    [
        (
            "user_id",
            pa.array([[1], [2], [-1], [3], [4], [5]], pa.list_(pa.int64())),
            "bad.parquet, row 2: column 'user_id': an id outside \\[0, 50\\).*the row holds \\[-1\\]",
        ),
        (
            "ad_id",
            pa.array([[1], [2], [3], [80], [4], [5]], pa.list_(pa.int64())),
            "row 3: column 'ad_id': an id outside \\[0, 80\\).*cardinality.*the row holds \\[80\\]",
        ),
        (
            "label_click",
            pa.array([0, 1, 1.5, 0, 0, 1], pa.float32()),
            "row 2: column 'label_click': outside \\[0, 1\\].*the row holds 1.5",
        ),
        (
            "dense",
            pa.array([[0, 0, 0]] * 3 + [[0, float("nan"), 0]] + [[0, 0, 0]] * 2, pa.list_(pa.float32())),
            "row 3: column 'dense': NaN or inf.*the row holds \\[0.0, nan, 0.0\\]",
        ),
        (
            "dense",
            pa.array([[0, 0, 0]] * 5 + [[0, 0]], pa.list_(pa.float32())),
            "row 5: column 'dense': not exactly data.schema.num_dense=3 values.*the row holds \\[0.0, 0.0\\]",
        ),
        (
            "domain",
            pa.array([0, 1, 2, 0, 0, 0], pa.int64()),
            "row 2: column 'domain': outside \\[0, data.schema.num_domains=2\\).*the row holds 2",
        ),
    ],
)
def test_bad_values_name_the_column_and_the_fix(tmp_path, tiny_schema, column, values, match):
    files = _write_with(tmp_path, tiny_schema, column, values)
    with pytest.raises(ValueError, match=match):
        _read_all(files, tiny_schema, 6)


def test_bad_files_and_folders(tmp_path, tiny_schema):
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="corrupt.parquet: not a readable Parquet file"):
        _read_all([tmp_path / "corrupt.parquet"], tiny_schema, 4)
    table = generate(tiny_schema, 5, seed=0).drop_columns(["hist_gap"])
    pq.write_table(table, tmp_path / "old.parquet")
    with pytest.raises(ValueError, match="old.parquet: column 'hist_gap': missing; layout v2 needs it"):
        _read_all([tmp_path / "old.parquet"], tiny_schema, 4)
    unequal = generate(tiny_schema, 3, seed=0)
    idx = unequal.schema.get_field_index("hist_action")
    unequal = unequal.set_column(
        idx, "hist_action", pa.array([[1, 2, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]] * 3, pa.list_(pa.int64()))
    )
    pq.write_table(unequal, tmp_path / "unequal.parquet")
    with pytest.raises(ValueError, match="need equal lengths"):
        _read_all([tmp_path / "unequal.parquet"], tiny_schema, 4)


def _odd_schema():
    """The tiny schema without 'ad_cluster' and with another 'ad_id' cardinality."""
    from gem.data.pipeline.schema import FeatureSchema
    from tests.conftest import TINY_SCHEMA

    cfg = {
        **TINY_SCHEMA,
        "id_features": [
            dict(f, cardinality=90) if f["name"] == "ad_id" else dict(f)
            for f in TINY_SCHEMA["id_features"]
            if f["name"] != "ad_cluster"
        ],
    }
    return FeatureSchema.from_config(cfg)


def test_files_written_with_different_schemas_fail_naming_both_files_and_the_feature(tmp_path, tiny_schema, capsys):
    """Issue #27.1: the schema was read from the first file only, so an odd file trained silently,
    or, sorting first, was taken for the data set's schema and the others were blamed ("layout v2")."""
    from gem.data.format.validate import main
    from gem.data.pipeline.loader import build_loader

    odd = _odd_schema()
    for i in range(3):
        write_parquet(generate(tiny_schema, 8, seed=i), tmp_path / "train" / f"part-{i}.parquet", tiny_schema)
    write_parquet(
        generate(tiny_schema, 8, seed=9).drop_columns(["ad_cluster"]), tmp_path / "train" / "a-odd.parquet", odd
    )  # sorts first
    files = split_files(tmp_path, "train")
    both = (
        r"a-odd.parquet and .*part-\d.parquet carry different gem.schema metadata \(feature 'ad_id' has cardinality "
        r"90 in train/a-odd.parquet, 80 in train/part-\d.parquet; feature 'ad_cluster' is absent in"
    )
    with pytest.raises(ValueError, match=both + r".*rewrite the odd file.*1 of 4 files differ from the other 3"):
        schema_from_files(files)
    with pytest.raises(ValueError, match=both):
        build_loader(files, tiny_schema, 4)
    with pytest.raises(ValueError, match=both):
        build_loader(files[::-1], tiny_schema, 4)  # the odd one last: still named first
    with pytest.raises(ValueError, match=both):
        _read_all(files, tiny_schema, 4)
    for split in ("val", "test"):
        write_parquet(generate(tiny_schema, 8, seed=5), tmp_path / split / "part-0.parquet", tiny_schema)
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "a-odd.parquet: its gem.schema differs from " in out
    assert re.search(r"feature 'ad_id' has cardinality 90 in train/a-odd.parquet, 80 in \w+/part-0.parquet", out)
    (tmp_path / "train" / "a-odd.parquet").unlink()
    assert schema_from_files(split_files(tmp_path, "train")) == tiny_schema and main([str(tmp_path)]) == 0


def test_a_data_dir_without_split_folders_says_what_was_expected_and_found(tmp_path, tiny_schema):
    """Issue #27.9: '.../train does not exist', and an empty-folder hint about the synthetic generator."""
    with pytest.raises(
        FileNotFoundError,
        match="data.dir='.*nope' does not exist; set data.dir to a gem data set: "
        "a folder with train/, val/ and test/ folders of \\*.parquet files",
    ):
        split_files(tmp_path / "nope", "train")
    write_parquet(generate(tiny_schema, 4, seed=0), tmp_path / "flat" / "part-0.parquet", tiny_schema)
    (tmp_path / "flat" / "notes").mkdir()
    with pytest.raises(
        FileNotFoundError,
        match=r"has no train/ folder: a gem data set holds train/, val/ and test/ "
        r"folders of \*.parquet files, and this folder holds the folders "
        r"\['notes/'\], 1 \*.parquet file; move its \*.parquet files into "
        r".*flat/train/ and hold some out in .*flat/val/ and .*flat/test/",
    ):
        split_files(tmp_path / "flat", "train")
    (tmp_path / "sets" / "ads" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="looks like a folder of data sets: set data.dir='.*sets/ads'"):
        split_files(tmp_path / "sets", "train")
    (tmp_path / "sets" / "ads" / "train" / "rows.csv").write_text("a,b\n")
    with pytest.raises(
        FileNotFoundError,
        match=r"ads/train holds no \*.parquet files \(it holds 1 \*.csv file\); put "
        r"the train split's Parquet files there",
    ) as e:
        split_files(tmp_path / "sets" / "ads", "train")
    assert "synthetic" not in str(e.value) and "generate" not in str(e.value)
