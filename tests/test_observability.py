"""Run hygiene: CPU threads against the CPUs really available, loggers (JSON lines, TensorBoard),
curves, one-line configuration errors, empty evaluation splits, metrics rows after a resume, and the
e2e benchmark's choice of windows."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest
import torch

from gem.train import startup


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cgroup_cpu_limit_reads_v2_and_v1(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")
    assert startup.cgroup_cpu_limit(str(tmp_path), str(proc)) == 1.5
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert startup.cgroup_cpu_limit(str(tmp_path), str(proc)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert startup.cgroup_cpu_limit(str(v1), str(tmp_path / "missing")) == 3.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert startup.cgroup_cpu_limit(str(v1), str(tmp_path / "missing")) is None


def test_threads_are_the_available_cpus_less_the_loader_workers(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(startup.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(startup, "cgroup_cpu_limit", lambda: None)
    assert "4 intra-op" in startup.configure_threads(None, 0) and torch.get_num_threads() == 4
    assert "3 intra-op" in startup.configure_threads(None, 1) and torch.get_num_threads() == 3
    assert "1 intra-op" in startup.configure_threads(None, 1, local_world_size=2)  # 2 CPUs per rank, less 1 worker
    assert "1 intra-op" in startup.configure_threads(None, 8)  # never below one
    monkeypatch.setattr(startup, "cgroup_cpu_limit", lambda: 2.5)  # a quota of 2.5 CPUs on a 4-core mask
    line = startup.configure_threads(None, 1)
    assert torch.get_num_threads() == 1 and "cgroup quota 2.5" in line
    assert "3 intra-op (trainer.num_threads)" in startup.configure_threads(3, 1) and torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert "OMP_NUM_THREADS=2" in startup.configure_threads(None, 1) and torch.get_num_threads() == 3  # left alone


def test_imports_without_a_bytecode_cache_are_told_apart(tmp_path, monkeypatch):
    """A module imported where no bytecode can be written (PYTHONDONTWRITEBYTECODE) was compiled from
    source, and so will be at the next start; once its bytecode is written, imports read it."""
    (tmp_path / "gem_bytecode_probe.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gem_bytecode_probe", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    importlib.import_module("gem_bytecode_probe")
    assert startup.imported_from_source("gem_bytecode_probe")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    importlib.reload(sys.modules["gem_bytecode_probe"])
    assert not startup.imported_from_source("gem_bytecode_probe")
    assert not startup.imported_from_source("gem_no_such_module") and not startup.imported_from_source("sys")


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _first_step(model: torch.nn.Module) -> tuple[dict | None, float]:
    """One forward / backward / optimizer step, measured as the trainer measures its first step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before, tick = startup.compile_counters(), time.perf_counter()
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return startup.compile_breakdown(before, startup.compile_counters()), time.perf_counter() - tick


def test_a_compiled_first_step_is_broken_down_into_dynamo_and_backend():
    model = _Tiny()
    model.compile()
    c, wall = _first_step(model)
    assert c is not None and c["frames"] >= 1 and c["graphs"] >= c["frames"], c
    assert min(c["dynamo"], c["backend"], c["backward"]) >= 0 and c["backend"] > 0, c
    # each rounded to 1 ms: dynamo + backend is the frame time +- 1 ms, backward +- 0.5 ms, the total
    # (frame + backward) +- 0.5 ms; 1e-9 for the float sum of rounded values
    assert c["dynamo"] + c["backend"] <= c["total"] + 1.5e-3 + 1e-9
    assert c["dynamo"] + c["backend"] + c["backward"] == pytest.approx(c["total"], abs=2e-3 + 1e-9)
    assert c["total"] <= wall
    assert _first_step(model)[0] is None  # compiled already
    timer = startup.StartupTimer()
    timer.phases["first step"], timer.compile = wall, c
    values = timer.summary()
    assert list(values)[-3:] == ["first step compile", "other", "total"]
    assert f"first step compile {c['total']:.2f}s (dynamo {c['dynamo']:.2f}s, backend" in startup.format_summary(values)


def test_an_eager_first_step_has_no_compile_entry():
    c, _ = _first_step(_Tiny())
    assert c is None
    timer = startup.StartupTimer()
    timer.phases["first step"], timer.compile = 0.1, c
    assert "first step compile" not in timer.summary()
    assert "compile" not in startup.format_summary(timer.summary())


@pytest.mark.parametrize("compile", [True, False])
def test_the_compile_workers_start_before_the_data_and_model_build(monkeypatch, tmp_path, compile):
    """With parallelism.compile, Inductor's worker pool starts first, so that its workers boot while
    the data and the model are built instead of inside the first step; without it, never."""
    from gem.train import setup, trainer

    calls = []

    class Stop(Exception):
        pass

    def build_source(*args, **kwargs):
        calls.append("data")
        raise Stop

    monkeypatch.setattr(trainer, "start_compile_workers", lambda: calls.append("workers"))
    monkeypatch.setattr(setup, "build_source", build_source)
    overrides = ["debug=tiny", f"trainer.run_dir={tmp_path}", f"parallelism.compile={str(compile).lower()}"]
    with pytest.raises(Stop):
        trainer.train(compose(overrides))
    assert calls == (["workers", "data"] if compile else ["data"])


# ------------------------------------------------------------------------------------- loggers

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

from gem.train.config import ConfigError, validate  # noqa: E402
from gem.train.logging import plot_curves  # noqa: E402
from gem.train.trainer import train  # noqa: E402
from tests.conftest import ROOT, compose  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _tiny(cache_dir, run_dir, *overrides):
    return compose(["debug=tiny", f"data.cache_dir={cache_dir}", f"trainer.run_dir={run_dir}", *overrides])


def test_tensorboard_scalars_and_curves_beside_the_jsonl(cache_dir, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        _tiny(
            cache_dir,
            tmp_path,
            "sparse=native",
            "trainer.max_steps=6",
            "trainer.log_every=2",
            "trainer.eval_every=3",
            "trainer.loggers=[jsonl,tensorboard]",
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/click/loss", "train/examples_per_s", "val/click/auc", "test/click/auc"} <= set(scalars)
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [r["loss"] for r in rows if r["kind"] == "train"]
    )
    assert 3 in [e.step for e in events.Scalars("val/click/auc")]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_missing_names_the_install(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install tensorboard, or set trainer.loggers=\[jsonl\]"):
        validate(compose(["trainer.loggers=[jsonl,tensorboard]"]))
    with pytest.raises(ConfigError, match="trainer.loggers"):
        validate(compose(["trainer.loggers=[wandb]"]))


def test_curves_are_skipped_without_matplotlib(monkeypatch, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 0.5}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure -> ImportError
    assert plot_curves(tmp_path) is None and not (tmp_path / "curves.png").exists()


# ------------------------------------------------------------------------------- resume and rows


def test_resume_after_a_kill_during_an_async_save_leaves_one_row_per_step(cache_dir, tmp_path):
    """SIGKILL after step 11, while step 10's asynchronous checkpoint was still uncommitted (a
    background save is committed at the next step's poll): the restart resumes from step 5 and
    trains 6-20 again. metrics.jsonl then holds each training step once, and one test row."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [
        "debug=tiny",
        f"data.cache_dir={cache_dir}",
        f"trainer.run_dir={tmp_path}",
        "trainer.log_every=1",
        "checkpoint.enabled=true",
        "checkpoint.every_steps=5",
        "checkpoint.async_save=true",
        "sparse=native",
        "trainer.loggers=[jsonl,tensorboard]",
        "trainer.plots=false",
    ]
    cmd = [sys.executable, "-m", "gem.train", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run(
        [sys.executable, "tests/faults.py", "--kill-at", "11:0", "--", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    first = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first if r["kind"] == "train"] == list(range(1, 11))
    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000000005" in resumed.stderr and "dropped 5 rows after step 5" in resumed.stderr, resumed.stderr[
        -3000:
    ]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 21))
    assert [r["kind"] for r in rows].count("test") == 1
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 21))  # purged from step 6 on, then rewritten

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)  # a finished run
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 21))
    assert [r["kind"] for r in rows].count("test") == 1  # re-evaluated, the old test row replaced


def test_a_line_cut_short_is_dropped_on_resume(tmp_path):
    from gem.train.logging import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"kind": "startup", "step": 0},
                {"kind": "train", "step": 5},
                {"kind": "val", "step": 5},
                {"kind": "train", "step": 6},
            ]
        )
        + '\n{"kind": "train", "st'
    )
    MetricsWriter(path, append=True, resume_step=5).write("train", 6, {"loss": 1.0})
    assert [(r["kind"], r["step"]) for r in map(json.loads, path.read_text().splitlines())] == [
        ("startup", 0),
        ("train", 5),
        ("val", 5),
        ("train", 6),
    ]


# ------------------------------------------------------------------------------- error reporting


def _main(*overrides, cwd, full_error=False, train=None):
    """``python -m gem.train overrides``; ``train``: the body of a ``train(cfg)`` to run instead of gem's."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | (
        {"HYDRA_FULL_ERROR": "1"} if full_error else {}
    )
    cmd = [sys.executable, "-m", "gem.train", *overrides]
    if train is not None:
        code = f"import sys, gem.train.__main__ as m\ndef train(cfg):\n    {train}\nm.train = train\nm.main()"
        cmd = [sys.executable, "-c", code, *overrides]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_a_configuration_mistake_is_one_line_and_a_crash_keeps_its_traceback(tmp_path):
    proc = _main("optim.dense.lr=-1", f"trainer.run_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert proc.returncode == 1
    assert _lines(proc.stderr) == ["Error in the configuration: optim.dense.lr=-1.0 must be > 0"], proc.stderr
    proc = _main("+trainer.no_such_key=1", f"trainer.run_dir={tmp_path / 'b'}", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "trainer.no_such_key" in proc.stderr
    proc = _main(f"trainer.run_dir={tmp_path / 'c'}", cwd=tmp_path, train="raise RuntimeError('a bug')")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RuntimeError: a bug" in proc.stderr, proc.stderr


def test_a_finished_rank_exits_0_without_finalization_and_keeps_its_log(tmp_path):
    """exit_without_finalization (a rank of a multi-process run): status 0, the log and stdout's
    buffer flushed, and no atexit handler run (Python's finalization skipped)."""
    log = tmp_path / "rank.log"
    code = (
        "import atexit, logging, gem.train.__main__ as m\n"
        f"handler = logging.FileHandler({str(log)!r})\n"
        "logging.getLogger().addHandler(handler)\n"
        "logging.getLogger().warning('the last line')\n"
        "atexit.register(print, 'finalized')\n"
        "print('still in the buffer', end='')\n"
        "m.exit_without_finalization()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe: block-buffered
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text() == "the last line\n"
    assert proc.stdout == "still in the buffer"  # flushed, and no atexit handler ran


def test_a_data_or_checkpoint_error_is_one_line_too(tmp_path):
    empty = tmp_path / "dataset"  # a data.dir without the split folders
    empty.mkdir()
    args = ("data=parquet", f"data.dir={empty}", f"trainer.run_dir={tmp_path / 'a'}")
    proc = _main(*args, cwd=tmp_path)
    assert proc.returncode == 1
    assert _lines(proc.stderr) == [
        f"Error in the data: data.dir='{empty}' has no train/ folder: a gem data set holds "
        f"train/, val/ and test/ folders of *.parquet files, and this folder holds nothing; "
        f"write each split's Parquet files (gem layout, docs/data.md) into {empty}/train/, "
        f"{empty}/val/, {empty}/test/"
    ], proc.stderr
    proc = _main(*args, cwd=tmp_path, full_error=True)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "MissingDataError" in proc.stderr, proc.stderr
    proc = _main(
        f"trainer.run_dir={tmp_path / 'b'}",
        cwd=tmp_path,
        train="from gem.train.checkpoint import CheckpointError; raise CheckpointError('step_5: truncated')",
    )
    assert proc.returncode == 1 and _lines(proc.stderr) == ["Error in the checkpoint: step_5: truncated"], proc.stderr


def test_a_damaged_file_a_gpu_kernel_without_gpu_and_a_bad_raw_id_are_one_line(tiny_dataset, tmp_path):
    """Issue 70: a truncated single train file was blamed on missing gem.schema metadata,
    kernels=triton without a GPU ran into Triton's "0 active drivers", and IdOutOfRangeError came
    with its traceback. Each is now one line naming the file or key and the fix (the three
    commands run side by side)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    first, *others = sorted((data / "train").glob("*.parquet"))
    for path in others:
        path.unlink()
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    parquet = ["debug=tiny", "data=parquet", "data.schema={}"]
    no_gpu = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "TRITON_INTERPRET")}
    no_gpu["CUDA_VISIBLE_DEVICES"] = ""
    runs = {
        "truncated": ([*parquet, f"data.dir={data}"], None),
        "triton": ([*parquet, f"data.dir={tiny_dataset}", "model=gem_tiny", "kernels=triton"], no_gpu),
        "raw id": ([*parquet, f"data.dir={tiny_dataset}", "sparse=native", "+sparse.ids.t_user_id.raw_space=3"], None),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "gem.train", *overrides, f"trainer.run_dir={tmp_path / name.replace(' ', '_')}"],
            cwd=tmp_path,
            env=env or {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (overrides, env) in runs.items()
    }
    done = {name: (proc.communicate(timeout=180)[1], proc.returncode) for name, proc in procs.items()}
    for name, (stderr, code) in done.items():
        assert code == 1 and "Traceback" not in stderr, (name, stderr)
    stderr, _ = done["truncated"]
    assert _lines(stderr)[-1].startswith(
        f"Error in the data: {first}: not a readable Parquet file, truncated or damaged ("
    ), stderr
    assert _lines(stderr)[-1].endswith("); write it again (or copy it whole), or move it out of the data set")
    assert _lines(done["triton"][0])[-1] == (
        "Error in the configuration: kernels=triton (kernels.attention_backend=triton) runs the attention on "
        "Triton kernels, which need a CUDA GPU, and this machine has none: use kernels=reference (or "
        "kernels=auto: Triton on a GPU, the reference elsewhere)"
    )
    assert re.fullmatch(
        r"Error in the data: feature 'user_id': id \d+ is outside its declared raw space \[0, 3\) "
        r"\(sparse.ids.t_user_id.raw_space\); fix the input, or raise sparse.ids.t_user_id.raw_space",
        _lines(done["raw id"][0])[-1],
    ), done["raw id"][0]


def test_a_data_error_from_a_loader_worker_prints_its_own_message():
    from torch._utils import ExceptionWrapper

    from gem.data import DataError
    from gem.train.__main__ import user_message

    try:
        raise DataError("part-0.parquet, row 3: column 'domain': outside [0, 3)")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataError) as e:
        wrapped.reraise()  # as the DataLoader raises it in the main process
    assert "Original Traceback" in str(e.value)
    assert user_message(e.value) == "part-0.parquet, row 3: column 'domain': outside [0, 3)"


# ------------------------------------------------------------------------------- empty splits


def test_an_empty_validation_split_is_skipped_with_a_warning_and_an_empty_test_split_fails(cache_dir, tmp_path):
    import shutil

    import gem

    overrides = ["sparse=native", "data.num_examples.val=0", "trainer.eval_every=10", "trainer.plots=false"]
    result = train(_tiny(cache_dir, tmp_path / "run", *overrides))
    assert 0 < result["click/auc"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["kind"] == "val"]
    assert "validation split" in (tmp_path / "run" / "train.log").read_text()
    with pytest.raises(ValueError, match="trainer.best_metric='click/auc' picks weights by validation, and the"):
        train(_tiny(cache_dir, tmp_path / "best", *overrides, "trainer.best_metric=click/auc"))

    data = gem.build_data(_tiny(cache_dir, tmp_path / "api", *overrides))
    with pytest.raises(ValueError, match="has no examples: AUC and NE would be NaN"):
        gem.evaluate(gem.build_model(data), data, "val")

    swapped = tmp_path / "swapped"  # the same data set with the empty split as its test split
    for split, source in (("train", "train"), ("val", "test"), ("test", "val")):
        shutil.copytree(data.dir / source, swapped / split)
    parquet = ["data=parquet", f"data.dir={swapped}", "data.schema={}", "sparse=native", "trainer.plots=false"]
    with pytest.raises(ValueError, match="the test split .* has no examples.*or set trainer.test=false"):
        train(_tiny(cache_dir, tmp_path / "run2", *parquet))
    shutil.rmtree(swapped / "test")  # a run that does not test needs no test split
    result = train(_tiny(cache_dir, tmp_path / "run3", *parquet, "trainer.test=false", "trainer.max_steps=2"))
    assert set(result) == {"train_seconds", "steps"} and result["steps"] == 2
    assert "end of training:" in (tmp_path / "run3" / "train.log").read_text()
    with pytest.raises(ValueError, match="the test split .* is missing"):
        train(_tiny(cache_dir, tmp_path / "run4", *parquet))


def test_e2e_benchmark_takes_its_figures_from_the_windows_after_warm_up_without_profiled_steps(tmp_path):
    """benchmarks/e2e.py's collect(): medians over the logged windows after --warmup, leaving out any
    window that holds a profiled step (or the profiler's warm-up step); every window's loss and step
    time are kept as well."""
    from benchmarks.e2e import collect

    rows = [
        {"kind": "train", "step": step, "loss": 1.0 / step, "step_ms": ms, "examples_per_s": 1000.0 / ms}
        for step, ms in ((10, 90.0), (20, 50.0), (30, 51.0), (40, 80.0), (50, 52.0), (60, 53.0))
    ] + [{"kind": "test", "step": 60, "click/auc": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "breakdown_rank0.json").write_text(json.dumps({"recorded_steps": [33, 38]}))
    result = collect("run", tmp_path, warmup=10)
    assert result["windows"] == 4  # 20, 30, 50, 60: the window of steps 31-40 held the profiled steps
    assert result["step_ms"] == 51.5 and result["test"]["click/auc"] == 0.7
    assert result["step_ms_by_window"] == {10: 90.0, 20: 50.0, 30: 51.0, 40: 80.0, 50: 52.0, 60: 53.0}


def test_e2e_benchmark_run_names_add_their_variant_and_bad_names_are_refused():
    """A run is <block>, <variant>-<block>, cold-<block> or warm-<block>; a name that is none of
    these (a variant since folded into the flagship, a typo) stops the benchmark before any run."""
    from benchmarks.e2e import NO_GRAPHS, parse_run

    assert parse_run("kunlun") == ("kunlun", []) and parse_run("warm-interformer") == ("interformer", [])
    assert parse_run("nographs-interformer") == ("interformer", NO_GRAPHS)
    assert parse_run("fbgemm-nopipe-kunlun") == ("kunlun", ["sparse=torchrec", "sparse.pipeline=false"])
    assert set(NO_GRAPHS) <= set(parse_run("padded-kunlun")[1])  # the baseline as measured: no CUDA graphs
    for bad in ("graphs2k-kunlun", "interformer-padded", "padded-dlrm"):
        with pytest.raises(ValueError, match=f"--runs {bad}: expected <block>"):
            parse_run(bad)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "benchmarks/e2e.py", "--runs", "kunlun", "rope-kunlun"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--runs rope-kunlun: expected" in done.stderr, done.stderr


@pytest.mark.parametrize("block", ["interformer", "kunlun"])
def test_e2e_padded_baseline_trains_both_blocks(cache_dir, tmp_path, monkeypatch, block):
    """benchmarks/e2e.py's padded baseline (every history padded, PyTorch attention) trains gem_tiny's
    blocks on the CPU: each attention call of the blocks, Kunlun's seed pooling over its packed K/V
    projection included, has its padded stand-in."""
    from gem.models import sequence

    for name in ("jagged_attention", "rotary_self_attention", "attention_pooling", "packed_kv_attention"):
        monkeypatch.setattr(sequence, name, getattr(sequence, name))  # the baseline replaces them: restored after
    padded = ("model=gem_tiny", f"model.block={block}", "model._target_=benchmarks.e2e.PaddedGEMDenseArch")
    result = train(_tiny(cache_dir, tmp_path, *padded, "trainer.max_steps=2", "trainer.test=false"))
    assert result["steps"] == 2 and sequence.packed_kv_attention.__module__ == "benchmarks.e2e"


def test_e2e_benchmark_plots_the_loss_curves_of_result_ab_and_transcribed_files(tmp_path):
    from benchmarks.e2e import loss_curves, plot_losses

    run = lambda name, shift: {"name": name, "losses": {"10": 1.2 + shift, "20": 1.1 + shift}}  # noqa: E731
    (tmp_path / "one.json").write_text(json.dumps({"results": [run("interformer", 0.0), run("kunlun", 0.1)]}))
    ab = {"runs": {"base": {"results": [run("kunlun", 0.0)]}, "new": {"results": [run("kunlun", 0.01)]}}}
    (tmp_path / "ab.json").write_text(json.dumps(ab))
    windows = lambda shift: {"10": {"loss": 1.3 + shift}, "20": {"loss": 1.2 + shift}}  # noqa: E731
    transcribed = {"runs": {"kunlun": {"windows": windows(0.0)}, "gluon-kunlun": {"windows": windows(0.02)}}}
    (tmp_path / "log.json").write_text(json.dumps(transcribed))
    files = [str(tmp_path / name) for name in ("one.json", "ab.json", "log.json")]
    curves = loss_curves(files)
    assert curves["interformer"] == {"interformer": {"10": 1.2, "20": 1.1}}
    # the run named kunlun is in every file: labelled by file or A/B label; the variant by its name
    assert set(curves["kunlun"]) == {"one", "base", "new", "log", "gluon-kunlun"}
    assert curves["kunlun"]["gluon-kunlun"] == {"10": 1.32, "20": 1.22}
    out = tmp_path / "losses.png"
    plot_losses(files, str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"
