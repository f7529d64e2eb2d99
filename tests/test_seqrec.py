import concurrent.futures
import dataclasses
import json
import math
import statistics
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from gem.data.format import dataset
from gem.data.format.dataset import schema_from_files, split_files
from gem.data.sources.seqrec import SeqRecOptions, prepare_seqrec, read_interactions, read_s3rec, write_seqrec
from gem.train.metrics import RankingEvaluator, positive_ranks, ranking_metrics
from gem.train.trainer import train
from tests.conftest import compose

NUM_ITEMS = 40


def _write_s3rec(directory, name="Tiny", num_users=30, seed=0, with_sample=False):
    rng = np.random.default_rng(seed)
    lines, sample = [], []
    for user in range(1, num_users + 1):
        items = rng.choice(np.arange(1, NUM_ITEMS + 1), size=int(rng.integers(3, 12)), replace=False)
        lines.append(" ".join(map(str, [user, *items])))
        unseen = np.setdiff1d(np.arange(1, NUM_ITEMS + 1), items)
        sample.append(" ".join(map(str, [user, *rng.choice(unseen, 20, replace=False)])))
    (directory / f"{name}.txt").write_text("\n".join(lines) + "\n")
    attrs = {str(i): [1 + i % 5, 6 + i % 3, 1 + i % 5] for i in range(1, NUM_ITEMS + 1)}  # repeats are dropped
    (directory / f"{name}_item2attributes.json").write_text(json.dumps(attrs))
    if with_sample:
        (directory / f"{name}_sample.txt").write_text("\n".join(sample) + "\n")
    return [np.array(line.split()[1:], dtype=np.int64) for line in lines]


def _rows(directory, split):
    return pq.ParquetDataset(directory / split).read().to_pylist()


def test_s3rec_leave_one_out_split_examples_and_negatives(tmp_path):
    sequences = _write_s3rec(tmp_path)
    out = tmp_path / "out"
    summary = write_seqrec(
        read_s3rec(tmp_path, "Tiny"),
        out,
        SeqRecOptions(max_len=4, num_negatives=2, num_eval_negatives=9, users_per_file=7),
    )
    schema = schema_from_files(split_files(out, "test"))
    assert schema.cardinality("item_id") == NUM_ITEMS + 1 and schema.group("hist").max_len == 4
    assert {f.name: f.table for f in schema.id_features}["item_id"] == "item" == schema.group("hist").features[0].table

    for split, back in (("val", 2), ("test", 1)):
        rows = _rows(out, split)
        assert len(rows) == 30 * 10 == summary["rows"][split]
        for user, seq in enumerate(sequences, 1):
            group = [r for r in rows if r["request_id"] == user]
            assert len(group) == 10 and sum(r["label_next_item"] for r in group) == 1
            positive = next(r for r in group if r["label_next_item"] == 1)
            assert positive["item_id"] == [seq[-back]], "leave-one-out target"
            assert all(r["hist_item"] == seq[:-back][-4:].tolist() for r in group), "the most recent 4 events"
            negatives = [r["item_id"][0] for r in group if r["label_next_item"] == 0]
            assert not set(negatives) & set(seq.tolist()), "negatives are items the user never touched"
            assert positive["item_attr"] == [1 + seq[-back] % 5, 6 + seq[-back] % 3]

    train_rows = _rows(out, "train")
    positives = [r for r in train_rows if r["label_next_item"] == 1]
    assert len(train_rows) == 3 * len(positives) == 3 * sum(len(s) - 3 for s in sequences)
    for r in positives:
        seq = sequences[r["user_id"][0] - 1]
        t = int(np.flatnonzero(seq == r["item_id"][0])[0])
        assert 1 <= t <= len(seq) - 3 and r["hist_item"] == seq[:t][-4:].tolist()
        assert r["dense"] == [pytest.approx(math.log1p(min(t, 4)))]


@pytest.mark.parametrize("objective", ["pointwise", "generative"])
def test_refit_trains_through_the_validation_target_and_drop_last_shifts_the_split(tmp_path, objective):
    """``refit``: the training part ends with the validation target and no val split is written;
    ``drop_last=1``: the test split is the full data's validation split, same rows and negatives."""
    sequences = _write_s3rec(tmp_path)
    data = read_s3rec(tmp_path, "Tiny")
    options = dict(objective=objective, max_len=20, num_negatives=2, num_eval_negatives=9, users_per_file=7)

    def last_targets(out):  # user -> the latest event its training rows predict
        latest = {}
        for r in _rows(out, "train"):
            user = r["user_id"][0]
            if objective == "generative":
                latest[user] = r["hist_item"][-1]
            elif r["label_next_item"] == 1:
                t = len(r["hist_item"])  # max_len 20 holds every history here
                latest[user] = max(latest.get(user, -1), t)
        if objective == "pointwise":
            latest = {u: int(sequences[u - 1][t]) for u, t in latest.items()}
        return latest

    def expected(back, min_len):  # pointwise rows exist where the training part has a target
        min_len = min_len + (objective == "pointwise")
        return {u: s[-back] for u, s in enumerate(sequences, 1) if len(s) >= min_len}

    base = write_seqrec(data, tmp_path / "base", SeqRecOptions(**options))
    refit = write_seqrec(data, tmp_path / "refit", SeqRecOptions(**options, refit=True))
    assert last_targets(tmp_path / "base") == expected(3, 3)
    assert last_targets(tmp_path / "refit") == expected(2, 2)
    assert refit["rows"]["val"] == 0 and not (tmp_path / "refit" / "val").exists()
    assert _rows(tmp_path / "refit", "test") == _rows(tmp_path / "base", "test")
    assert refit["items_only_in_evaluation"] <= base["items_only_in_evaluation"]

    shifted = write_seqrec(data, tmp_path / "shifted", SeqRecOptions(**options, drop_last=1))
    assert shifted["users_kept"] == sum(len(s) >= 4 for s in sequences) < base["users_kept"]
    assert last_targets(tmp_path / "shifted") == expected(4, 4)
    # Where no user is dropped (as in the 5-core public sets), the same users draw the same negatives:
    # the shifted test split is the validation split, row for row.
    long = dataclasses.replace(data, sequences=[s for s in data.sequences if len(s) >= 4])
    write_seqrec(long, tmp_path / "long", SeqRecOptions(**options))
    write_seqrec(long, tmp_path / "long_shifted", SeqRecOptions(**options, drop_last=1))
    assert _rows(tmp_path / "long_shifted", "test") == _rows(tmp_path / "long", "val")
    with pytest.raises(ValueError, match="drop_last=-1"):
        SeqRecOptions.from_config({"drop_last": -1})


def test_s3rec_fixed_negatives_and_bad_files(tmp_path):
    sequences = _write_s3rec(tmp_path, with_sample=True)
    data = read_s3rec(tmp_path, "Tiny")
    write_seqrec(data, tmp_path / "out", SeqRecOptions(num_eval_negatives=99))
    rows = [r for r in _rows(tmp_path / "out", "test") if r["request_id"] == 3]
    expected = (tmp_path / "Tiny_sample.txt").read_text().splitlines()[2].split()[1:]
    assert len(rows) == 21 and sorted(r["item_id"][0] for r in rows[1:]) == sorted(map(int, expected))
    assert rows[0]["item_id"] == [sequences[2][-1]]

    with pytest.raises(FileNotFoundError, match="data.name to one of \\['Tiny'\\]"):
        read_s3rec(tmp_path, "Missing")
    (tmp_path / "Bad.txt").write_text("1 3 4\n2 x 5\n")
    with pytest.raises(ValueError, match="Bad.txt, line 2: expected 'user item item ...'"):
        read_s3rec(tmp_path, "Bad")


def test_runs_sharing_a_cache_convert_once(tmp_path, monkeypatch):
    """Runs started together on one data.cache_dir (a seed sweep) used to race: each converted into
    the same scratch folder and one failed renaming a file the other had moved."""
    import gem.data.sources.seqrec as seqrec

    _write_s3rec(tmp_path)
    calls = []

    def slow_write(*args, **kwargs):
        calls.append(1)
        time.sleep(0.3)  # long enough for every thread to find the folder missing
        return write_seqrec(*args, **kwargs)

    monkeypatch.setattr(seqrec, "write_seqrec", slow_write)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: prepare_seqrec(tmp_path, "Tiny", tmp_path / "cache"), range(4)))
    assert len(calls) == 1 and len(set(folders)) == 1
    assert split_files(folders[0], "train") and not list((tmp_path / "cache").glob("*.partial"))


def test_a_cache_without_file_locks_still_converts(tmp_path, monkeypatch, caplog):
    def no_locks(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(dataset.fcntl, "flock", no_locks)
    made = []
    with caplog.at_level("WARNING", logger="gem"):
        assert dataset.make_once(tmp_path / "set", lambda: made.append((tmp_path / "set").mkdir()), True, 1, "make")
    assert made and "cannot lock" in caplog.text and "No locks available" in caplog.text


@pytest.mark.parametrize("fmt", ["dat", "csv"])
def test_movielens_tables_order_by_time_and_remap_ids(tmp_path, fmt):
    # user, item, rating, timestamp; user 7's items arrive out of order in the file.
    rows = [
        (7, 100, 5, 30),
        (7, 205, 3, 10),
        (7, 100, 4, 20),
        (9, 300, 1, 5),
        (7, 300, 2, 40),
        (9, 205, 5, 6),
        (9, 100, 5, 7),
        (9, 999, 4, 8),
    ]
    if fmt == "dat":
        text = "\n".join("::".join(map(str, r)) for r in rows)
    else:
        text = "userId,movieId,rating,timestamp\n" + "\n".join(",".join(map(str, r)) for r in rows)
    (tmp_path / f"ratings.{fmt}").write_text(text + "\n")
    data = read_interactions(tmp_path / f"ratings.{fmt}")
    ids = {100: 1, 205: 2, 300: 3, 999: 4}
    assert data.num_items == 4
    assert [s.tolist() for s in data.sequences] == [
        [ids[205], ids[100], ids[100], ids[300]],
        [ids[300], ids[205], ids[100], ids[999]],
    ]
    high = read_interactions(tmp_path / f"ratings.{fmt}", min_rating=4)  # item 300 drops out: ids 1..3
    assert [s.tolist() for s in high.sequences] == [[1, 1], [2, 1, 3]] and high.num_items == 3
    out = prepare_seqrec(tmp_path, f"ratings.{fmt}", tmp_path / "cache", {"num_eval_negatives": 0, "num_negatives": 0})
    test = _rows(out, "test")
    assert [(r["request_id"], r["item_id"], r["hist_item"]) for r in test] == [(1, [3], [2, 1, 1]), (2, [4], [3, 2, 1])]
    assert (
        prepare_seqrec(tmp_path, f"ratings.{fmt}", tmp_path / "cache", {"num_eval_negatives": 0, "num_negatives": 0})
        == out
    ), "cached"


# -- ranking metrics, hand-computed ------------------------------------------------------------
def test_positive_ranks_count_ties_against_the_model():
    scores = torch.tensor([0.9, 0.9, 0.95, 0.1, 5.0, 1.0, 2.0, 0.3, 0.2])
    labels = torch.tensor([1, 0, 0, 0, 0, 1, 0, 1, 0])
    groups = torch.tensor([3, 3, 3, 3, 7, 7, 7, 8, 8])
    assert positive_ranks(scores, labels, groups).tolist() == [2, 2, 0]
    assert positive_ranks(torch.zeros(4), torch.tensor([0, 0, 1, 0]), torch.zeros(4)).tolist() == [3]


def test_ranking_metrics_by_hand():
    got = ranking_metrics(torch.tensor([0, 2, 7, 30]))
    assert got["hr@1"] == pytest.approx(1 / 4)
    assert got["hr@5"] == pytest.approx(2 / 4)
    assert got["hr@10"] == pytest.approx(3 / 4)
    assert got["ndcg@5"] == pytest.approx((1 + 1 / math.log2(4)) / 4)
    assert got["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4) + 1 / math.log2(9)) / 4)
    assert got["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 8 + 1 / 31) / 4)
    # standard errors: the per-row values' sample standard deviation over sqrt(4)
    assert got["hr@10_se"] == pytest.approx(statistics.stdev([1, 1, 1, 0]) / 2)
    assert got["ndcg@5_se"] == pytest.approx(statistics.stdev([1, 1 / math.log2(4), 0, 0]) / 2)
    assert got["mrr_se"] == pytest.approx(statistics.stdev([1, 1 / 3, 1 / 8, 1 / 31]) / 2)
    assert math.isnan(ranking_metrics(torch.tensor([3]))["hr@10_se"])
    assert all(math.isnan(v) for v in ranking_metrics(torch.tensor([], dtype=torch.long)).values())


def test_ranking_evaluator_groups_across_batches_and_skips_masked_rows():
    ev = RankingEvaluator(("next_item",))
    # group 1: positive 0.5 vs negatives 0.9, 0.1 (rank 1); group 2: positive 0.7 vs 0.2 (rank 0);
    # a masked row with a huge score does not count.
    ev.update(
        torch.tensor([[0.5], [0.9]]), torch.tensor([[1.0], [0.0]]), torch.tensor([[True], [True]]), torch.tensor([1, 1])
    )
    ev.update(
        torch.tensor([[0.1], [0.7], [0.2], [9.0]]),
        torch.tensor([[0.0], [1.0], [0.0], [0.0]]),
        torch.tensor([[True], [True], [True], [False]]),
        torch.tensor([1, 2, 2, 2]),
    )
    got = ev.compute()
    assert got["next_item/groups"] == 2 and got["next_item/hr@1"] == pytest.approx(0.5)
    assert got["next_item/mrr"] == pytest.approx((1 / 2 + 1) / 2)
    assert got["next_item/ndcg@5"] == pytest.approx((1 / math.log2(3) + 1) / 2)


def test_seqrec_experiment_trains_and_writes_test_metrics(tmp_path):
    _write_s3rec(tmp_path, num_users=60)
    cfg = compose(
        [
            "experiment=seqrec",
            f"data.dir={tmp_path}",
            "data.name=Tiny",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"trainer.run_dir={tmp_path / 'run'}",
            "data.batch_size=32",
            "data.num_workers=0",
            "data.eval_batch_size=500",
            "trainer.max_steps=15",
            "trainer.progress_bar=false",
            "data.seqrec.num_eval_negatives=20",
        ]
    )
    result = train(cfg)
    saved = json.loads((tmp_path / "run" / "test_metrics.json").read_text())
    for key in ("hr@1", "hr@5", "hr@10", "ndcg@5", "ndcg@10", "mrr"):
        assert 0 <= saved[f"next_item/{key}"] <= 1 and saved[f"next_item/{key}"] == pytest.approx(
            result[f"next_item/{key}"]
        )
    assert (
        saved["next_item/groups"] == 60
        and saved["next_item/hr@1"] <= saved["next_item/hr@5"] <= saved["next_item/hr@10"]
    )


def test_the_seqrec_benchmark_reports_the_runs_without_the_prior_apart():
    """``benchmarks/seqrec.py --without-prior``: each run's scores with the prior off are summarized
    beside, not into, the recipe's own."""
    from benchmarks.seqrec import METRICS, summarize

    def one(with_prior: float, alone: float) -> dict:
        scores = {m: with_prior for m in METRICS}
        return {"set": "LastFM", "seconds": 1.0, "hr@10_se": 0.01, "ndcg@10_se": 0.01, **scores,
                "without_prior": {m: alone for m in METRICS}}  # fmt: skip

    summary = summarize([one(0.6, 0.3), one(0.6, 0.4)])["LastFM"]
    assert summary["hr@10"] == {"mean": 0.6, "std": 0.0}
    assert summary["without_prior"]["hr@10"]["mean"] == pytest.approx(0.35)
    assert summary["without_prior"]["ndcg@10"]["std"] == pytest.approx(0.0707, abs=1e-4)
    assert (
        "without_prior" not in summarize([{k: v for k, v in one(0.6, 0.3).items() if k != "without_prior"}])["LastFM"]
    )


def test_the_seqrec_benchmark_chooses_on_validation_without_reading_the_test_split():
    """``benchmarks/seqrec.py --split val``: the runs validate (after every epoch unless told) and
    skip the test split; ``--split test`` leaves the overrides as given."""
    from benchmarks.seqrec import run_overrides

    assert run_overrides(["a=1"], "val", None, False) == ["a=1", "trainer.test=false", "trainer.eval_every=-1"]
    assert run_overrides(["trainer.eval_every=100"], "val", None, False)[-1] == "trainer.test=false"
    assert run_overrides(["a=1"], "test", None, True) == ["a=1", "checkpoint.enabled=true"]


def test_the_seqrec_benchmark_refuses_a_run_folder_that_holds_an_earlier_run(tmp_path, monkeypatch):
    """Two invocations with the same run folders: the second would resume the first's final
    checkpoint and report its model as its own, so it stops before running anything."""
    import sys

    from benchmarks import seqrec

    (tmp_path / "LastFM-1").mkdir()
    monkeypatch.setattr(seqrec, "run", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr(sys, "argv", ["seqrec.py", "--sets", "LastFM", "--seeds", "0", "1", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="LastFM-1 holds an earlier run, which the trainer would resume"):
        seqrec.main()


def test_the_seqrec_benchmark_keeps_the_runs_that_finished_when_one_fails(tmp_path, monkeypatch):
    """A failed run is named and left out of the summary; the others' records are written."""
    import subprocess
    import sys

    from benchmarks import seqrec

    def run(experiment, name, seed, *args):
        if seed == 1:
            raise subprocess.CalledProcessError(1, ["python", "-m", "gem.train"])
        scores = {m: 0.5 for m in seqrec.METRICS}
        return {"set": name, "seed": seed, "seconds": 1.0, "hr@10_se": 0.01, "ndcg@10_se": 0.01, **scores}

    monkeypatch.setattr(seqrec, "ROOT", tmp_path)
    monkeypatch.setattr(seqrec, "run", run)
    monkeypatch.setattr(sys, "argv", ["seqrec.py", "--sets", "LastFM", "--seeds", "0", "1", "2", "--tag", "t"])
    with pytest.raises(SystemExit, match="LastFM seed 1: exit status 1"):
        seqrec.main()
    record = json.loads((tmp_path / "benchmarks" / "results" / "seqrec-seqrec_gen-t.json").read_text())
    assert [r["seed"] for r in record["runs"]] == [0, 2] and [r["seed"] for r in record["failed"]] == [1]
    assert record["summary"]["LastFM"]["hr@10"] == {"mean": 0.5, "std": 0.0}
