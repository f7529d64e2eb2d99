import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem.data.format.dataset import split_files
from gem.data.format.layout import write_parquet
from gem.data.format.reader import LoaderOptions
from gem.data.pipeline.balance import deal_by_length, imbalance
from gem.data.pipeline.loader import build_loader
from gem.data.sources.synthetic import generate


def _keys(batches):
    """One hashable key per example (its dense values are unique in synthetic data)."""
    return [tuple(row) for b in batches for row in b.dense.tolist()]


def _all_rows(tiny_dataset, tiny_schema):
    return sorted(_keys(build_loader(split_files(tiny_dataset, "train"), tiny_schema, 1000)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_and_workers_partition_every_row_once(tiny_dataset, tiny_schema, num_workers):
    files = split_files(tiny_dataset, "train")  # 700 rows in files of 300
    world = 3
    loaders = [
        build_loader(
            files,
            tiny_schema,
            32,
            shuffle=True,
            seed=5,
            rank=r,
            world_size=world,
            num_workers=num_workers,
            options={"window_batches": 2},
        )
        for r in range(world)
    ]
    per_rank = [list(loader) for loader in loaders]
    keys = [k for batches in per_rank for k in _keys(batches)]
    assert sorted(keys) == _all_rows(tiny_dataset, tiny_schema), "no overlap, no loss"
    assert [sum(b.batch_size for b in bs) for bs in per_rank] == [233, 233, 234]
    assert [len(bs) for bs in per_rank] == [len(loader) for loader in loaders] == [8, 8, 8]

    dropping = [build_loader(files, tiny_schema, 32, drop_last=True, rank=r, world_size=world) for r in range(world)]
    assert dropping[0].steps_per_epoch == 7 == 700 // (32 * world)
    assert all(len(list(d)) == 7 and all(b.batch_size == 32 for b in d) for d in dropping)


def test_shuffle_is_seeded_per_epoch_and_permutes(tiny_dataset, tiny_schema):
    files = split_files(tiny_dataset, "train")
    make = lambda seed: build_loader(files, tiny_schema, 50, shuffle=True, seed=seed)  # noqa: E731
    a, b, c = make(1), make(1), make(2)
    first = _keys(a)
    assert first == _keys(b)
    assert first != _keys(c)
    a.set_epoch(1)
    second = _keys(a)
    assert second != first and sorted(second) == sorted(first) == _all_rows(tiny_dataset, tiny_schema)


@pytest.mark.parametrize("num_workers, stop", [(0, 5), (2, 3), (2, 8)])
def test_resume_continues_exactly_where_it_stopped(tiny_dataset, tiny_schema, num_workers, stop):
    files = split_files(tiny_dataset, "train")

    def make():
        return build_loader(
            files, tiny_schema, 40, shuffle=True, seed=3, num_workers=num_workers, options={"window_batches": 3}
        )

    full = make()
    full.set_epoch(2)
    expected = _keys(full)

    first = make()
    first.set_epoch(2)
    head = []
    for i, batch in enumerate(first):  # interrupted mid-epoch, with batches prefetched but unconsumed
        head.append(batch)
        if i + 1 == stop:
            break
    state = json.loads(json.dumps(first.state_dict()))  # plain ints / strings / lists
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    tail = list(resumed)
    assert _keys(head) + _keys(tail) == expected, "no example lost or repeated, same order"
    assert resumed.stats["rows"] == 700

    other = build_loader(files, tiny_schema, 41, shuffle=True, seed=3, num_workers=num_workers)
    with pytest.raises(ValueError, match="batch_size=40, this run has 41"):
        other.load_state_dict(state)


def test_deal_by_length_balances_and_keeps_every_row():
    lengths = np.array([90, 70, 40, 30, 20, 5])
    groups = deal_by_length(lengths, 2)
    assert [sorted(lengths[g].tolist()) for g in groups] == [[5, 30, 90], [20, 40, 70]]
    rng = np.random.default_rng(0)
    lengths = np.round(rng.lognormal(3, 1.2, size=4096)).astype(int)
    groups = deal_by_length(lengths, 16, order=rng.permutation(4096))
    assert sorted(np.concatenate(groups).tolist()) == list(range(4096))
    assert {len(g) for g in groups} == {256}
    tokens = np.array([lengths[g].sum() for g in groups])
    assert tokens.max() - tokens.min() <= lengths.max(), "within one row of each other"
    assert tokens.max() / tokens.mean() < 1.03


def _rank_step_tokens(files, schema, balance, world=4, batch_size=64):
    per_rank = []
    for r in range(world):
        loader = build_loader(
            files,
            schema,
            batch_size,
            shuffle=True,
            seed=0,
            drop_last=True,
            rank=r,
            world_size=world,
            options={"balance": balance, "window_batches": 8},
        )
        per_rank.append([int(b.sequences["hist_item"].lengths().sum()) for b in loader])
    steps = min(map(len, per_rank))
    return np.array([t[:steps] for t in per_rank]).T  # [steps, ranks]


def test_balancing_evens_tokens_across_ranks_per_step(tmp_path, tiny_schema):
    table = generate(tiny_schema, 4096, seed=1)
    write_parquet(table, tmp_path / "train.parquet", tiny_schema, row_group_size=1024)
    before = imbalance(_rank_step_tokens([tmp_path / "train.parquet"], tiny_schema, balance=False))
    after = imbalance(_rank_step_tokens([tmp_path / "train.parquet"], tiny_schema, balance=True))
    assert after["max_over_mean_mean"] < before["max_over_mean_mean"]
    assert after["max_over_mean_mean"] < 1.08, (before, after)


# -- bad input: each case fails with a message naming file, row, column, or is skipped and counted ---
def _write(tmp_path, tiny_schema, column=None, values=None, name="bad.parquet", n=6):
    table = generate(tiny_schema, n, seed=0)
    if column is not None:
        table = table.set_column(table.schema.get_field_index(column), column, values)
    write_parquet(table, tmp_path / name, tiny_schema)
    return tmp_path / name


IDS = pa.list_(pa.int64())
ROW_CASES = [
    ("id_out_of_range", "user_id", pa.array([[1], [2], [-1], [3], [4], [5]], IDS), 2),
    ("id_out_of_range", "ad_id", pa.array([[1], [2], [3], [80], [4], [5]], IDS), 3),
    (
        "non_finite_dense",
        "dense",
        pa.array([[0, 0, 0]] * 3 + [[0, float("nan"), 0]] + [[0, 0, 0]] * 2, pa.list_(pa.float32())),
        3,
    ),
    (
        "non_finite_dense",
        "dense",
        pa.array([[0, 0, 0]] + [[float("inf"), 0, 0]] + [[0, 0, 0]] * 4, pa.list_(pa.float32())),
        1,
    ),
    ("dense_length", "dense", pa.array([[0, 0, 0]] * 5 + [[0, 0]], pa.list_(pa.float32())), 5),
    ("label_out_of_range", "label_click", pa.array([0, 1, 1.5, 0, 0, 1], pa.float32()), 2),
    ("label_out_of_range", "label_click", pa.array([0, -0.5, 1, 0, 0, 1], pa.float32()), 1),
    ("domain_out_of_range", "domain", pa.array([0, 1, 2, 0, 0, 0], pa.int64()), 2),
    ("null_value", "domain", pa.array([0, 1, None, 0, 0, 0], pa.int64()), 2),
]


@pytest.mark.parametrize("case, column, values, row", ROW_CASES)
def test_bad_rows_fail_naming_file_row_and_column_or_are_skipped_and_counted(
    tmp_path, tiny_schema, case, column, values, row
):
    path = _write(tmp_path, tiny_schema, column, values)
    with pytest.raises(ValueError, match=rf"bad.parquet, row {row}: column '{column}'.*on_error.{case}=skip"):
        list(build_loader([path], tiny_schema, 4))
    loader = build_loader([path], tiny_schema, 4, options={"on_error": {case: "skip"}})
    batches = list(loader)
    assert sum(b.batch_size for b in batches) == 5
    assert loader.stats["skipped_rows"] == 1 and loader.stats[f"skipped/{case}"] == 1 and loader.stats["rows"] == 5
    if column != "dense":  # dense values identify the rows: exactly the bad one is gone
        (whole,) = build_loader(
            [_write(tmp_path, tiny_schema, name="good.parquet")], tiny_schema, 6, options={"balance": False}
        )
        file_order = _keys([whole])
        assert sorted(_keys(batches)) == sorted(file_order[:row] + file_order[row + 1 :])


def test_corrupt_and_truncated_files(tmp_path, tiny_schema):
    good = _write(tmp_path, tiny_schema, name="good.parquet", n=40)
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 not really")
    data = good.read_bytes()
    (tmp_path / "truncated.parquet").write_bytes(data[: len(data) // 2])
    for name in ("corrupt.parquet", "truncated.parquet"):
        with pytest.raises(ValueError, match=f"{name}: .*not a readable Parquet file.*unreadable_file=skip"):
            build_loader([good, tmp_path / name], tiny_schema, 8)
    loader = build_loader(
        [tmp_path / "corrupt.parquet", good, tmp_path / "truncated.parquet"],
        tiny_schema,
        8,
        options={"on_error": {"default": "skip"}},
    )
    assert sum(b.batch_size for b in loader) == 40
    assert loader.stats["skipped_files"] == 2 and loader.stats["skipped/unreadable_file"] == 2


def test_corrupt_data_pages_behind_a_good_footer(tmp_path, tiny_schema):
    path = _write(tmp_path, tiny_schema, name="pages.parquet", n=40)
    data = bytearray(path.read_bytes())
    data[8:400] = b"\xff" * 392  # clobber the first data pages, keep the footer
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="pages.parquet: row group 0 is corrupt or truncated"):
        list(build_loader([path], tiny_schema, 8))
    loader = build_loader([path], tiny_schema, 8, options={"on_error": {"unreadable_file": "skip"}})
    assert list(loader) == [] and loader.stats["skipped/unreadable_file"] == 40


def test_schema_mismatch_and_missing_column(tmp_path, tiny_schema):
    table = generate(tiny_schema, 10, seed=0)
    good = _write(tmp_path, tiny_schema, name="good.parquet", n=10)
    pq.write_table(table.drop_columns(["hist_gap"]), tmp_path / "missing.parquet")
    idx = table.schema.get_field_index("domain")
    pq.write_table(table.set_column(idx, "domain", pa.array(["a"] * 10)), tmp_path / "mismatch.parquet")
    with pytest.raises(ValueError, match="missing.parquet: column 'hist_gap': missing.*on_error.missing_column=skip"):
        build_loader([tmp_path / "missing.parquet"], tiny_schema, 4)
    with pytest.raises(ValueError, match="mismatch.parquet: column 'domain': has Arrow type string.*schema_mismatch"):
        build_loader([tmp_path / "mismatch.parquet"], tiny_schema, 4)
    loader = build_loader(
        [tmp_path / "missing.parquet", good, tmp_path / "mismatch.parquet"],
        tiny_schema,
        4,
        options={"on_error": {"missing_column": "skip", "schema_mismatch": "skip"}},
    )
    assert sum(b.batch_size for b in loader) == 10
    assert loader.stats["skipped/missing_column"] == 1 and loader.stats["skipped/schema_mismatch"] == 1
    with pytest.raises(ValueError, match="data.loader.on_error.typo: unknown case"):
        LoaderOptions.from_config({"on_error": {"typo": "skip"}})
    with pytest.raises(ValueError, match="data.loader: unknown keys \\['windows'\\]"):
        LoaderOptions.from_config({"windows": 2})


def test_long_histories_keep_the_most_recent_events_and_are_counted(tmp_path, tiny_schema, caplog):
    table = generate(tiny_schema, 4, seed=0)
    offsets = [0, 20, 20, 21, 36]
    for name in tiny_schema.sequence_feature_names:
        ids = pa.ListArray.from_arrays(offsets, pa.array(np.arange(36) % tiny_schema.cardinality(name), pa.int64()))
        table = table.set_column(table.schema.get_field_index(name), name, ids)
    write_parquet(table, tmp_path / "long.parquet", tiny_schema)
    loader = build_loader([tmp_path / "long.parquet"], tiny_schema, 4, options={"balance": False})
    with caplog.at_level("WARNING", logger="gem"):
        (batch,) = list(loader)
    jt = batch.sequences["hist_item"]
    assert jt.lengths().tolist() == [12, 0, 1, 12]
    assert jt.values().tolist() == list(range(8, 20)) + [20] + list(range(24, 36))
    assert loader.stats["truncated_histories"] == 2 and batch.max_seq_len["hist"] == 12
    assert "cut to the most recent events" in caplog.text


def test_batches_match_the_files_value_for_value(tmp_path, tiny_schema):
    table = generate(tiny_schema, 203, seed=4).append_column("request_id", pa.array(np.arange(203) // 7, pa.int64()))
    write_parquet(table, tmp_path / "a.parquet", tiny_schema, row_group_size=50)
    batches = list(build_loader([tmp_path / "a.parquet"], tiny_schema, 64, options={"balance": False}))
    assert [b.batch_size for b in batches] == [64, 64, 64, 11]
    for name in tiny_schema.sequence_feature_names:
        got = torch.cat([b.sequences[name].values() for b in batches]).numpy()
        assert np.array_equal(got, table[name].combine_chunks().flatten().to_numpy())
    for name in tiny_schema.id_feature_names:
        got = torch.cat([b.sparse[name].values() for b in batches]).numpy()
        assert np.array_equal(got, table[name].combine_chunks().flatten().to_numpy())
    assert torch.cat([b.request_id for b in batches]).tolist() == (np.arange(203) // 7).tolist()
    mask = torch.cat([b.label_mask for b in batches])[:, 1].numpy()
    assert np.array_equal(mask, table["label_mask_conversion"].to_numpy())
    balanced = list(build_loader([tmp_path / "a.parquet"], tiny_schema, 64))
    assert sorted(_keys(balanced)) == sorted(_keys(batches))


def test_layout_v1_files_stay_readable(tmp_path, tiny_schema):
    path = _write(tmp_path, tiny_schema, name="v1.parquet", n=9)
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[b"gem.layout_version"] = b"1"
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "v1.parquet")
    (batch,) = list(build_loader([tmp_path / "v1.parquet"], tiny_schema, 9))
    assert batch.batch_size == 9 and batch.request_id is None
    meta[b"gem.layout_version"] = b"3"
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "v3.parquet")
    with pytest.raises(ValueError, match="gem.layout_version 3 is not one of"):
        build_loader([tmp_path / "v3.parquet"], tiny_schema, 9)


@pytest.mark.gpu
def test_pinned_batches_reach_the_gpu(tiny_dataset, tiny_schema):
    loader = build_loader(split_files(tiny_dataset, "val"), tiny_schema, 32, num_workers=1, pin_memory=True)
    batch = next(iter(loader))
    assert batch.dense.is_pinned() and batch.sequences.values().is_pinned()
    on_gpu = batch.to("cuda", non_blocking=True)
    assert on_gpu.sequences.values().is_cuda and on_gpu.labels.is_cuda


def test_validator_reports_every_violation_with_row_and_column(tmp_path, tiny_schema, capsys):
    from gem.data.format.validate import main, validate_file

    table = generate(tiny_schema, 8, seed=0)
    table = table.set_column(
        table.schema.get_field_index("user_id"), "user_id", pa.array([[1], [-4], [2], [3], [99], [5], [6], [7]], IDS)
    )
    table = table.set_column(
        table.schema.get_field_index("label_click"),
        "label_click",
        pa.array([0, 1, 0, 2, 0, 0, 0, float("nan")], pa.float32()),
    )
    dense = [[0.0, 0.0, 0.0]] * 8
    dense[4] = [float("inf"), 0.0, 0.0]
    table = table.set_column(table.schema.get_field_index("dense"), "dense", pa.array(dense, pa.list_(pa.float32())))
    write_parquet(table, tmp_path / "bad.parquet", tiny_schema, row_group_size=3)
    found = [(v.row, v.column, v.case) for v in validate_file(tmp_path / "bad.parquet")]
    assert found == [
        (1, "user_id", "id_out_of_range"),
        (3, "label_click", "label_out_of_range"),
        (4, "dense", "non_finite_dense"),
        (4, "user_id", "id_out_of_range"),
        (7, "label_click", "label_out_of_range"),
    ]
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "bad.parquet: row 4, column 'dense': NaN or inf" in out and out.count("\n") == 5
    (tmp_path / "bad.parquet").unlink()
    _write(tmp_path, tiny_schema, name="good.parquet")
    assert validate_file(tmp_path / "good.parquet") == [] and main([str(tmp_path)]) == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_carry_their_ids_per_key_so_the_device_needs_no_sync(tiny_dataset, tiny_schema, num_workers):
    """The KJTs count their ids per key on the host: on a GPU, TorchRec would count them with a
    device-to-host copy at every batch's first to_dict()."""
    loader = build_loader(split_files(tiny_dataset, "train"), tiny_schema, 64, num_workers=num_workers)
    batch = next(iter(loader))
    for kjt in (batch.sparse, batch.sequences):
        expected = kjt.lengths().view(len(kjt.keys()), -1).sum(1).tolist()
        assert kjt._length_per_key == expected
        assert kjt.to("cpu")._length_per_key == expected


def test_validator_fails_on_empty_folders_and_missing_splits(tmp_path, tiny_schema, capsys):
    """Issue #27.2: `python -m gem.data.validate` exited 0 on empty split folders and on an empty data.dir."""
    from gem.data.format.validate import main

    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    captured = capsys.readouterr()
    assert "empty: holds no *.parquet files (it holds nothing); give a data set folder" in captured.out
    assert "0 files, 0 with violations, 1 layout problem(s)" in captured.err
    assert main([str(tmp_path / "nowhere")]) == 1 and "nowhere: does not exist" in capsys.readouterr().out
    data = tmp_path / "data"
    for split in ("train", "val", "test"):
        (data / split).mkdir(parents=True)
    _write(data / "train", tiny_schema, name="part-0.parquet")
    assert main([str(data)]) == 1
    out = capsys.readouterr().out
    assert "data/val: holds no *.parquet files (it holds nothing); put the val split's Parquet files there" in out
    assert "data/test: holds no *.parquet files" in out
    (data / "test").rmdir()
    assert main([str(data)]) == 1
    assert "data: no test/ folder; a gem data set holds train/, val/ and test/" in capsys.readouterr().out
    (data / "test").mkdir()
    for split in ("val", "test"):
        _write(data / split, tiny_schema, name="part-0.parquet")
    assert main([str(data)]) == 0


def _empty(path):
    """``path`` rewritten with no rows (its schema and gem metadata kept)."""
    table = pq.read_table(path)
    pq.write_table(table.slice(0, 0).replace_schema_metadata(table.schema.metadata), path)


def test_validator_fails_on_zero_row_train_or_test_splits_and_warns_on_val(tmp_path, tiny_schema, capsys):
    """Issue 70: a split whose files hold no rows passed the validator, and training refused it
    (train, test) or validated nothing (val). A data set without val/ trains (with a warning): the
    validator warns too, and names Parquet files that training does not read."""
    from gem.data.format.validate import main

    data = tmp_path / "data"
    for split in ("train", "val", "test"):
        _write(data / split, tiny_schema, name="part-0.parquet")
    _empty(data / "val" / "part-0.parquet")
    assert main([str(data)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        f"warning: {data / 'val'}: its 1 file(s) hold no rows; training runs without validation (it warns, and "
        "trainer.best_metric fails): write examples there to validate"
    ]
    assert "3 files, 0 with violations, 1 warning(s)" in out.err
    for split in ("train", "test"):
        _empty(data / split / "part-0.parquet")
    assert main([str(data)]) == 1
    out = capsys.readouterr().out
    assert f"{data / 'train'}: its 1 file(s) hold no rows; training refuses an empty training split" in out
    assert f"{data / 'test'}: its 1 file(s) hold no rows; training refuses to end on NaN test metrics" in out
    _write(data / "train", tiny_schema, name="part-0.parquet")
    _write(data / "test", tiny_schema, name="part-0.parquet")
    (data / "val" / "part-0.parquet").unlink()
    (data / "val").rmdir()
    _write(data / "train" / "old", tiny_schema, name="part-0.parquet")  # a subfolder: not read by training
    assert main([str(data)]) == 0
    out = capsys.readouterr().out
    assert f"warning: {data}: no val/ folder; training runs without validation" in out
    unread = data / "train" / "old" / "part-0.parquet"
    assert f"{data}: 1 *.parquet file(s) that training does not read (e.g. {unread})" in out


def _stream(root, tiny_schema, days):
    for day in days:
        _write(root / f"day={day}", tiny_schema, name="part-0.parquet")
    return root


def test_validator_checks_a_stream_as_training_does(tmp_path, tiny_schema, capsys):
    """Issue 70: the validator passed stream folders that training refuses (a stray folder, a date that
    does not exist, a partition without rows) and said nothing of a day missing in the middle; with a
    stream run's checkpoint it checks the order that run's resume needs."""
    import json

    from gem.data.format.validate import main

    events = _stream(tmp_path / "events", tiny_schema, ["2026-11-23", "2026-11-24", "2026-11-27"])
    assert main([str(events)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        f"warning: data.dir={events}: 2 day(s) missing between day=2026-11-23 and day=2026-11-27: "
        "day=2026-11-25..day=2026-11-26; the stream trains on the days it holds, and a missing day that arrives "
        "after a run has trained past it stops the next run (partitions out of order): add it before training "
        "past it"
    ]
    assert "3 files, 0 with violations, 1 warning(s)" in out.err
    for stray, message in [
        ("day=2026-02-30", "partition 'day=2026-02-30' has no valid date (day is out of range for month); rename it"),
        ("2026-11-25", "'2026-11-25' is not a partition folder day=YYYY-MM-DD; move it out of data.dir"),
    ]:
        (events / stray).mkdir()
        assert main([str(events)]) == 1
        assert f"data.dir={events}: {message}" in capsys.readouterr().out
        (events / stray).rmdir()
    (events / "day=2026-11-25").mkdir()  # a partition without files
    assert main([str(events)]) == 1
    assert f"{events / 'day=2026-11-25'} holds no *.parquet files (it holds nothing)" in capsys.readouterr().out
    _write(events / "day=2026-11-25", tiny_schema, name="part-0.parquet")
    _empty(events / "day=2026-11-25" / "part-0.parquet")
    assert main([str(events)]) == 1
    assert f"{events / 'day=2026-11-25'}: its 1 file(s) hold no rows; a stream run scores each partition before" in (
        capsys.readouterr().out
    )
    (events / "day=2026-11-25" / "part-0.parquet").unlink()
    (events / "day=2026-11-25").rmdir()

    # a run that stood in day=2026-11-24 (one partition before it) when it saved step 16
    step = tmp_path / "run" / "checkpoints" / "step_000000016"
    step.mkdir(parents=True)
    (step / "loader_rank0.json").write_text(json.dumps({"partition": "day=2026-11-24", "partitions_before": 1}))
    assert main([str(events), "--checkpoint", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    _write(events / "day=2026-11-20", tiny_schema, name="part-0.parquet")  # a day dated before it appears
    assert main([str(events), "--checkpoint", str(step)]) == 1
    assert (
        f"data.dir={events}: partitions out of order: the checkpoint stands in day=2026-11-24, which had 1 "
        "partition(s) before it, now 2 (day=2026-11-20, day=2026-11-23): a partition dated before it appeared"
    ) in capsys.readouterr().out
    assert main([str(events), "--checkpoint", str(tmp_path)]) == 1
    assert "neither it nor a step_N folder in it holds loader_rank0.json" in capsys.readouterr().out
