"""Streaming (data.kind=stream, gem/data/sources/stream.py): one pass over day partitions in date
order, each example once; every partition scored before it is trained on; a SIGKILLed run resumes
exactly (losses, tables, managed-collision state, the delta chain); partitions out of order, a
missing one and stray folders fail naming them. Small: 3 days of 1,000 examples, batches of 128
(8 steps a day, the last one short)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gem.data.errors import DataError
from gem.data.format.validate import main as validate
from gem.data.sources.stream import list_partitions
from gem.train.config import ConfigError
from gem.train.delta import main as delta_main
from gem.train.trainer import train
from tests.conftest import ROOT, TINY_SCHEMA, compose
from tests.faults import example_ids

RUN = [
    "experiment=stream",
    "data.stream.days=3",
    "data.stream.examples_per_day=1000",
    "data.batch_size=128",
    "data.eval_batch_size=512",
    "trainer.deterministic=true",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "trainer.plots=false",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=0",
]
DAYS = ["day=2026-11-23", "day=2026-11-24", "day=2026-11-25"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _overrides(cache_dir, run_dir, *extra):
    return [*RUN, f"data.cache_dir={cache_dir}", f"trainer.run_dir={run_dir}", *extra]


class _Examples:
    """A step hook: the examples of every step, in order."""

    def __init__(self):
        self.steps: list[list[str]] = []

    def __call__(self, step, rank, batch):
        self.steps.append(example_ids(batch.dense))


def _rows(folder: Path) -> list[str]:
    dense = pq.read_table(sorted(folder.glob("*.parquet")), columns=["dense"]).column("dense").combine_chunks()
    return example_ids(torch.from_numpy(np.asarray(dense.flatten().to_numpy(), np.float32).reshape(len(dense), -1)))


def _rows_of(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _stream_dir(cache_dir) -> Path:
    (folder,) = [p for p in Path(cache_dir).glob("*-stream-*") if p.is_dir() and not p.name.endswith(".partial")]
    return folder


@pytest.fixture(scope="module")
def one_pass(cache_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pass")
    examples = _Examples()
    result = train(compose(_overrides(cache_dir, run_dir)), hooks=[examples])
    return run_dir, examples, result


def test_one_pass_in_date_order_each_example_once(cache_dir, one_pass):
    run_dir, examples, result = one_pass
    data = _stream_dir(cache_dir)
    assert list_partitions(data) == DAYS
    per_day = [_rows(data / day) for day in DAYS]
    assert [len(r) for r in per_day] == [1000] * 3 and len(set().union(*per_day)) == 3000
    seen = [e for step in examples.steps for e in step]
    assert Counter(seen) == Counter(e for day in per_day for e in day)  # every example exactly once
    day_of = {e: i for i, day in enumerate(per_day) for e in day}
    assert [day_of[e] for e in seen] == sorted(day_of[e] for e in seen)  # the days in order
    assert len(examples.steps) == 24 and result["steps"] == 24  # 8 steps a day, the last short (1000 = 7 x 128 + 104)


def test_each_partition_is_scored_before_training_on_it(one_pass):
    run_dir, _, result = one_pass
    rows = _rows_of(run_dir, "stream")
    assert [(r["partition"], r["step"], r["click/count"]) for r in rows] == [
        (d, 8 * i, 1000) for i, d in enumerate(DAYS)
    ]
    first_train_step = min(r["step"] for r in _rows_of(run_dir, "train"))
    assert rows[0]["step"] < first_train_step  # day 1 scored by the untrained model
    assert 0.4 < rows[0]["click/auc"] < 0.6 < rows[-1]["click/auc"]  # and later days by a model that learned
    summary = json.loads((run_dir / "stream_metrics.json").read_text())
    assert sorted(summary["partitions"]) == DAYS and result["partitions"] == 3
    assert result["click/auc"] == pytest.approx(np.mean([r["click/auc"] for r in rows]))


def test_new_ids_appear_over_time(cache_dir, one_pass):  # one_pass generates the stream
    """The synthetic stream renews users' and items' raw ids (data.stream.id_lifetime_days=3)."""
    data = _stream_dir(cache_dir)
    users = [
        set(pq.read_table(data / d, columns=["user_id"]).column("user_id").combine_chunks().flatten().to_pylist())
        for d in DAYS
    ]
    assert max(max(u) for u in users) >= 2000  # raw ids beyond the table's 2,000 rows
    new_on_day_3 = users[2] - users[0] - users[1]
    assert 0.05 < len(new_on_day_3) / len(users[2]) < 0.9


# ---------------------------------------------------------------------------------- exact resume


def _torchrun(cache_dir, run_dir, *extra, faults=(), ranks=1):
    entry = [str(ROOT / "tests" / "faults.py"), *faults, "--"] if faults else ["-m", "gem.train"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "--max-restarts=1",
        *entry,
        *_overrides(cache_dir, run_dir, *extra),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _state(folder: Path, tmp: Path) -> dict:
    dcp_to_torch_save(folder, tmp / f"{folder.name}.pt")
    return torch.load(tmp / f"{folder.name}.pt", weights_only=False)


def test_sigkill_mid_partition_resumes_exactly(cache_dir, one_pass, tmp_path):
    """SIGKILLed after step 13 (day 2's 5th step; the newest checkpoint is step 10): torchrun restarts
    it; the examples of the surviving history, the losses, the tables with their managed-collision
    state, the optimizer and the delta chain equal the uninterrupted run's."""
    reference, _, _ = one_pass
    log = tmp_path / "examples"
    log.mkdir()
    run = tmp_path / "run"
    _torchrun(cache_dir, run, faults=["--kill-at", "13:0", "--example-log", str(log)])
    rows = [json.loads(line) for line in (log / "rank0.jsonl").read_text().splitlines()]
    assert (
        max(r["step"] for r in rows if r["attempt"] == 0) == 13
        and min(r["step"] for r in rows if r["attempt"] == 1) == 11
    )
    history = {r["step"]: r["ids"] for r in rows if r["attempt"] == 1 or r["step"] <= 10}
    data = _stream_dir(cache_dir)
    assert Counter(e for ids in history.values() for e in ids) == Counter(e for d in DAYS for e in _rows(data / d))
    losses = lambda r: {x["step"]: x["loss"] for x in _rows_of(r, "train")}  # noqa: E731
    assert losses(run) == losses(reference)
    assert [(r["partition"], r["click/auc"]) for r in _rows_of(run, "stream")] == [
        (r["partition"], r["click/auc"]) for r in _rows_of(reference, "stream")
    ]
    final, ref = (
        _state(run / "checkpoints" / "step_000000024", tmp_path),
        _state(reference / "checkpoints" / "step_000000024", tmp_path),
    )
    keys = [k for k in ref if k.startswith(("model.", "optim.")) and isinstance(ref[k], torch.Tensor)]
    assert any(".ids.mch." in k for k in keys)
    for key in keys:
        torch.testing.assert_close(final[key], ref[key], rtol=0, atol=0, msg=key)
    manifests = [json.loads((run / "deltas" / f"{s:06d}" / "manifest.json").read_text()) for s in range(3)]
    assert [(m["partition"], m["step"]) for m in manifests] == [(d, 8 * (i + 1)) for i, d in enumerate(DAYS)]
    out = tmp_path / "applied"
    assert (
        delta_main(
            [
                "apply",
                "--base",
                str(run / "checkpoints" / "step_000000000"),
                "--deltas",
                str(run / "deltas"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    applied = _state(out, tmp_path)
    for key in (k for k in keys if k.startswith("model.")):
        torch.testing.assert_close(applied[key], ref[key], rtol=0, atol=0, msg=key)


def test_two_ranks_train_each_example_once(cache_dir, tmp_path):
    """Two gloo ranks split each day's batches (a day's last, short batch on one of them); deltas are
    one process only, so off here."""
    log = tmp_path / "examples"
    log.mkdir()
    _torchrun(
        cache_dir, tmp_path / "run", "trainer.delta_export.every=null", faults=["--example-log", str(log)], ranks=2
    )
    seen = [
        e for r in (0, 1) for line in (log / f"rank{r}.jsonl").read_text().splitlines() for e in json.loads(line)["ids"]
    ]
    data = _stream_dir(cache_dir)
    assert Counter(seen) == Counter(e for d in DAYS for e in _rows(data / d))
    assert [(r["partition"], r["click/count"]) for r in _rows_of(tmp_path / "run", "stream")] == [
        (d, 1000) for d in DAYS
    ]


# ------------------------------------------------------------------------------------- bad input


@pytest.fixture
def own_stream(cache_dir, one_pass, tmp_path):
    """A copy of the synthetic stream's first two days as a data.dir (``one_pass`` generates the
    stream, also where a test runner's worker has run no earlier test of this module)."""
    data = tmp_path / "events"
    data.mkdir()
    for day in DAYS[:2]:
        shutil.copytree(_stream_dir(cache_dir) / day, data / day)
    return data


def test_new_partitions_continue_and_earlier_ones_fail(cache_dir, own_stream, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(compose(_overrides(cache_dir, run, f"data.dir={own_stream}")))["steps"] == 16
    shutil.copytree(_stream_dir(cache_dir) / DAYS[2], own_stream / DAYS[2])  # the next day arrives
    assert train(compose(_overrides(cache_dir, run, f"data.dir={own_stream}")))["steps"] == 24
    assert [r["partition"] for r in _rows_of(run, "stream")] == DAYS  # day 3 only was added
    assert validate([str(own_stream), "--checkpoint", str(run)]) == 0  # the validator reads the run's checkpoint
    shutil.copytree(own_stream / DAYS[0], own_stream / "day=2026-11-20")  # a day before the trained ones
    out_of_order = (
        r"partitions out of order: the checkpoint stands in day=2026-11-25, which had "
        r"2 partition\(s\) before it, now 3 \(day=2026-11-20, day=2026-11-23, "
        r"day=2026-11-24\): a partition dated before it appeared"
    )
    with pytest.raises(DataError, match=out_of_order):
        train(compose(_overrides(cache_dir, run, f"data.dir={own_stream}")))
    assert validate([str(own_stream), "--checkpoint", str(run)]) == 1  # and finds what training refuses
    assert re.search(out_of_order, capsys.readouterr().out)
    shutil.rmtree(own_stream / "day=2026-11-20")
    shutil.rmtree(own_stream / DAYS[2])
    with pytest.raises(DataError, match="the checkpoint stands in partition 3, but data.dir holds 2"):
        train(compose(_overrides(cache_dir, run, f"data.dir={own_stream}")))
    assert validate([str(own_stream), "--checkpoint", str(run)]) == 1
    assert "the checkpoint stands in partition 3, but data.dir holds 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, match",
    [
        ("2026-11-26", "'2026-11-26' is not a partition folder day=YYYY-MM-DD"),
        ("day=2026-13-01", "partition 'day=2026-13-01' has no valid date"),
    ],
)
def test_stray_folders_are_named(own_stream, name, match):
    (own_stream / name).mkdir()
    with pytest.raises(DataError, match=match):
        list_partitions(own_stream)


def test_a_stream_has_no_validation_split(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="trainer.eval_every: a stream has no validation split"):
        train(compose(_overrides(cache_dir, tmp_path / "run", "trainer.eval_every=5")))
    with pytest.raises(ConfigError, match="trainer.best_metric='click/auc': a stream has no validation split"):
        train(compose(_overrides(cache_dir, tmp_path / "run", "trainer.best_metric=click/auc")))


def test_a_resume_at_a_partition_boundary_keeps_one_score_per_partition(tmp_path):
    """A partition is scored at the step before its first batch; resuming from a checkpoint at that
    step scores it again, so the rows from that step on are the rolled-back history's."""
    from gem.train.logging import MetricsWriter

    rows = [{"kind": "stream", "step": s, "partition": d} for s, d in ((0, DAYS[0]), (8, DAYS[1]), (16, DAYS[2]))]
    rows += [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, 20)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    MetricsWriter._drop_rolled_back(path, resume_step=8)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["partition"] for r in kept if r["kind"] == "stream"] == [DAYS[0]]
    assert [r["step"] for r in kept if r["kind"] == "train"] == list(range(1, 9))


def test_a_day_missing_in_the_middle_trains_with_one_warning_naming_it(cache_dir, tmp_path, tiny_schema):
    """Issue 70: a stream with a missing day trained with no word. Now one warning line names the
    missing days (once per run) and the run trains the days it holds."""
    from gem.data.format.layout import write_parquet
    from gem.data.sources.synthetic import generate

    events = tmp_path / "events"
    for i, day in enumerate(["2026-11-23", "2026-11-24", "2026-11-26"]):
        write_parquet(generate(tiny_schema, 64, seed=i), events / f"day={day}" / "part-0.parquet", tiny_schema)
    run = tmp_path / "run"
    overrides = _overrides(cache_dir, run, f"data.dir={events}", "data.batch_size=32", "checkpoint.enabled=false")
    cfg = compose([*overrides, "trainer.delta_export.every=null"])
    cfg.data.schema = TINY_SCHEMA  # the files' (experiment=stream's is the synthetic one)
    result = train(cfg)
    assert result["steps"] == 6 and result["partitions"] == 3
    log = (run / "train.log").read_text()
    assert log.count("missing between") == 1, log
    assert (
        f"data.dir={events}: 1 day(s) missing between day=2026-11-23 and day=2026-11-26: day=2026-11-25; the "
        "stream trains on the days it holds"
    ) in log
