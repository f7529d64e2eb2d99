"""Checkpoints: exact resume (1 process and 2 gloo ranks), a SIGKILLed rank under torchrun,
resharding 2 ranks -> 1, and bad checkpoints. Every run is the tiny debug config (20 steps of
64 examples; with 2 ranks an epoch is 15 steps, so the runs cross an epoch boundary)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gem.data.format.dataset import split_files
from gem.data.pipeline.schema import FeatureSchema
from gem.data.sources.synthetic import synthetic_dir
from gem.train.checkpoint import Checkpointer, CheckpointError, Progress, list_checkpoints
from gem.train.config import ConfigError, validate
from gem.train.optim import build_optimizers
from gem.train.setup import build_model, init_distributed, load_data
from gem.train.trainer import train
from tests.conftest import ROOT, compose
from tests.faults import example_ids

RUN = [
    "debug=tiny",
    "trainer.deterministic=true",
    "trainer.log_every=1",
    "checkpoint.enabled=true",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=3",
]
TIMEOUT_S = 240  # a whole torchrun job; torchrun stops every worker as soon as one fails


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _overrides(cache_dir, run_dir, *extra):
    return [*RUN, f"data.cache_dir={cache_dir}", f"trainer.run_dir={run_dir}", *extra]


def _losses(run_dir: Path) -> dict[int, float]:
    """Train loss per step; a step logged twice (re-run after a restart) keeps its last value."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def _torchrun(cache_dir, run_dir, *extra, faults=(), max_restarts=0):
    """``python -m gem.train`` on two ranks; with ``faults`` (tests/faults.py flags), tests/faults.py instead."""
    entry = [str(ROOT / "tests" / "faults.py"), *faults, "--"] if faults else ["-m", "gem.train"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        f"--max-restarts={max_restarts}",
        *entry,
        *_overrides(cache_dir, run_dir, *extra),
        "trainer.progress_bar=false",
    ]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _lineage(checkpoint: Path) -> str | None:
    return json.loads((checkpoint / "gem_checkpoint.json").read_text()).get("lineage")


def _interrupt(src: Path, dst: Path, keep_through_step: int) -> None:
    """A copy of run ``src`` as if it had crashed after its checkpoint at ``keep_through_step``."""
    shutil.copytree(src, dst)
    for ckpt in list_checkpoints(dst / "checkpoints"):
        if int(ckpt.name.split("_")[1]) > keep_through_step:
            shutil.rmtree(ckpt)


@pytest.fixture(scope="module")
def single_run(cache_dir, tmp_path_factory):
    """One uninterrupted process: 20 steps, cosine schedule with warm-up, a DataLoader worker."""
    run_dir = tmp_path_factory.mktemp("single")
    train(
        compose(_overrides(cache_dir, run_dir, "optim.schedule=cosine", "optim.warmup_steps=3", "data.num_workers=1"))
    )
    return run_dir


@pytest.fixture(scope="module")
def two_rank_run(cache_dir, tmp_path_factory):
    """Two gloo ranks under torchrun: TorchRec-sharded tables (row-wise, table-wise and
    data-parallel in the planner's plan), FSDP2 dense arch; 20 steps."""
    run_dir = tmp_path_factory.mktemp("two_ranks")
    _torchrun(cache_dir, run_dir)
    return run_dir


# ------------------------------------------------------------------------------------ exact resume


def test_checkpoints_are_committed_and_pruned(single_run):
    names = [p.name for p in list_checkpoints(single_run / "checkpoints")]
    assert names == ["step_000000010", "step_000000015", "step_000000020"]  # keep_last=3
    newest = single_run / "checkpoints" / "step_000000020"
    manifest = json.loads((newest / "gem_checkpoint.json").read_text())
    assert manifest["step"] == 20 and manifest["world_size"] == 1
    assert {".metadata", "__0_0.distcp", "rng_rank0.pkl"} <= set(manifest["files"])
    assert not list((single_run / "checkpoints").glob(".tmp-*"))
    startup = json.loads((single_run / "startup.json").read_text())
    assert {"imports", "model build", "sharding", "checkpoint load", "first batch", "first step"} <= set(startup)
    phases = {k: v for k, v in startup.items() if k not in ("total", "other", "kernel_fallbacks")}
    assert startup["total"] >= sum(phases.values()) - 1e-3 and startup["kernel_fallbacks"] == []


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_one_process_is_bit_identical(cache_dir, single_run, tmp_path, async_save):
    """Crash after step 10's checkpoint, restart the same command: steps 11-20 give the same losses,
    bit for bit, as the uninterrupted run. The resumed run writes checkpoints 15 and 20 (sync or in
    the background); crash it after 15 and restart once more: steps 16-20 again match."""
    overrides = _overrides(
        cache_dir,
        tmp_path / "run",
        "optim.schedule=cosine",
        "optim.warmup_steps=3",
        "data.num_workers=1",
        f"checkpoint.async_save={async_save}",
    )
    _interrupt(single_run, tmp_path / "run", keep_through_step=10)
    train(compose(overrides))
    expected, resumed = _losses(single_run), _losses(tmp_path / "run")
    assert [resumed[s] for s in range(11, 21)] == [expected[s] for s in range(11, 21)]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000000020")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    train(compose(overrides))
    resumed = _losses(tmp_path / "run")
    assert sorted(resumed) == list(range(16, 21))
    assert [resumed[s] for s in range(16, 21)] == [expected[s] for s in range(16, 21)]
    # Both restarts kept the run's lineage id: the checkpoints they wrote carry the interrupted run's.
    lineage = _lineage(single_run / "checkpoints" / "step_000000010")
    assert re.fullmatch("[0-9a-f]{32}", lineage)
    assert {_lineage(c) for c in list_checkpoints(tmp_path / "run" / "checkpoints")} == {lineage}


def test_resume_two_ranks_is_bit_identical(cache_dir, two_rank_run, tmp_path):
    _interrupt(two_rank_run, tmp_path / "run", keep_through_step=10)
    _torchrun(cache_dir, tmp_path / "run")
    expected, resumed = _losses(two_rank_run), _losses(tmp_path / "run")
    assert [resumed[s] for s in range(11, 21)] == [expected[s] for s in range(11, 21)]


def test_sigterm_on_one_rank_stops_both_after_the_step_and_the_restart_loses_nothing(cache_dir, two_rank_run, tmp_path):
    """Rank 1 receives SIGTERM during step 12: both ranks finish it, checkpoint step 12 and exit 143;
    torchrun's restart resumes at step 13 with the uninterrupted run's losses."""
    proc = _torchrun(cache_dir, tmp_path / "run", faults=["--signal-at", "12:1"], max_restarts=1)
    assert "stopped by SIGTERM after step 12" in proc.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_000000012").is_dir()
    expected, resumed = _losses(two_rank_run), _losses(tmp_path / "run")
    assert [resumed[s] for s in range(1, 21)] == [expected[s] for s in range(1, 21)]


def test_sigkilled_rank_restarts_and_resumes_with_no_example_lost_or_repeated(cache_dir, two_rank_run, tmp_path):
    """Rank 1 SIGKILLs itself after step 12 (checkpoints at 5 and 10); torchrun restarts both ranks,
    which resume at step 10. Every rank logs a hash of each example it trained on per step; the
    surviving history (per rank and step, the last attempt) holds each example once per epoch."""
    log_dir = tmp_path / "examples"
    log_dir.mkdir()
    proc = _torchrun(
        cache_dir, tmp_path / "run", faults=["--kill-at", "12:1", "--example-log", str(log_dir)], max_restarts=1
    )
    records = {
        rank: [json.loads(line) for line in (log_dir / f"rank{rank}.jsonl").read_text().splitlines()] for rank in (0, 1)
    }
    by_attempt = {a: [r for rank in (0, 1) for r in records[rank] if r["attempt"] == a] for a in (0, 1)}
    assert max(r["step"] for r in by_attempt[0]) >= 12, "the first attempt must run past its last checkpoint"
    assert min(r["step"] for r in by_attempt[1]) == 11, "the restart must resume from the checkpoint at step 10"
    assert "resumed from" in proc.stdout + proc.stderr

    history: dict[tuple[int, int], list[str]] = {}
    for rank in (0, 1):
        for r in records[rank]:
            history[(rank, r["step"])] = r["ids"]  # a later attempt replaces a rolled-back step
    assert sorted(history) == [(rank, step) for rank in (0, 1) for step in range(1, 21)]
    train_ids = {i for f in split_files(_data_dir(cache_dir), "train") for i in _row_ids(f)}
    for epoch, steps in ((0, range(1, 16)), (1, range(16, 21))):
        seen = [i for rank in (0, 1) for s in steps for i in history[(rank, s)]]
        assert len(seen) == len(set(seen)) == len(steps) * 2 * 64, f"epoch {epoch}: an example was lost or repeated"
        assert set(seen) <= train_ids
    # And the restarted job's losses are the uninterrupted job's, bit for bit.
    expected, resumed = _losses(two_rank_run), _losses(tmp_path / "run")
    assert [resumed[s] for s in range(1, 21)] == [expected[s] for s in range(1, 21)]


def _data_dir(cache_dir) -> Path:
    d = validate(compose(_overrides(cache_dir, "unused"))).data
    return synthetic_dir(d.cache_dir, d.name, FeatureSchema.from_config(d.schema), d.num_examples, d.seed, d.synthetic)


def _row_ids(file: Path) -> list[str]:
    dense = pq.read_table(file, columns=["dense"]).column("dense").combine_chunks()
    rows = np.asarray(dense.flatten().to_numpy(), dtype=np.float32).reshape(len(dense), -1)
    return example_ids(torch.from_numpy(rows))


# ----------------------------------------------------------------------------------------- reshard


def _components(cache_dir, run_dir, *extra):
    """Model, optimizers and a Checkpointer as train() builds them, in this process (world size 1)."""
    config = validate(compose(_overrides(cache_dir, run_dir, *extra)))
    env = init_distributed("cpu", need_process_group=True)
    schema, _ = load_data(config, env)
    model = build_model(config, schema, env)
    dense_opt, sparse_opt, scheduler = build_optimizers(model, config.optim, total_steps=20)
    ckpt = Checkpointer(
        config.checkpoint,
        Path(run_dir) / "checkpoints",
        model,
        dense_opt,
        sparse_opt,
        scheduler,
        OmegaConf.to_yaml(OmegaConf.structured(config)),
    )
    return model, ckpt


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.local_shards()[0].tensor if hasattr(t, "local_shards") else t


def test_reshard_two_ranks_into_one(cache_dir, two_rank_run, tmp_path):
    """The 2-rank checkpoint (row-wise, table-wise and data-parallel tables, FSDP2 dense shards) loads
    into one process (every table table-wise or row-wise on rank 0, plain dense): every table, its
    Adagrad momentum and every dense parameter equal the checkpoint's full tensors."""
    source = two_rank_run / "checkpoints" / "step_000000010"
    full_path = tmp_path / "full.pt"
    dcp_to_torch_save(source, full_path)
    full = torch.load(full_path, weights_only=False)
    lineage = _lineage(source)  # rank 0's id, in the manifest and (one entry for both ranks) in DCP's state
    assert re.fullmatch("[0-9a-f]{32}", lineage) and full["lineage"] == lineage
    model, ckpt = _components(cache_dir, tmp_path / "run", f"checkpoint.load_from={source}")
    try:
        assert ckpt.lineage != lineage  # a new one until a checkpoint is loaded
        progress = ckpt.restore()
        assert (progress.step, progress.epoch, progress.examples_in_epoch) == (10, 0, 10 * 2 * 64)
        assert ckpt.lineage == lineage  # the resharded run continues the 2-rank run's lineage
        sparse = {f"model.sparse.{k}": _local(v) for k, v in model.sparse_arch.module.state_dict().items()}
        dense = {f"model.dense.{k}": v for k, v in model.dense_arch.state_dict().items()}
        assert len(sparse) == 9 and len(dense) > 5
        for key, value in (sparse | dense).items():
            torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
        momentum = model.sparse_arch.fused_optimizer.state_dict()["state"]
        assert len(momentum) == 9  # every table is fused here; three were data-parallel when saved
        for fqn, states in momentum.items():
            (value,) = states.values()
            torch.testing.assert_close(_local(value), full[f"optim.sparse.{fqn}.momentum1"], rtol=0, atol=0, msg=fqn)
    finally:
        dist.destroy_process_group()
    # And training continues from there: steps 11-20 in one process, with the same global batch.
    train(compose(_overrides(cache_dir, tmp_path / "run2", f"checkpoint.load_from={source}", "data.batch_size=128")))
    assert sorted(_losses(tmp_path / "run2")) == list(range(11, 21))
    assert {_lineage(c) for c in list_checkpoints(tmp_path / "run2" / "checkpoints")} == {lineage}


# ------------------------------------------------------------------------------------ bad checkpoints


@pytest.fixture
def damaged(single_run, tmp_path):
    """A copy of the single-process run's checkpoints, for a test to damage."""
    shutil.copytree(single_run / "checkpoints", tmp_path / "run" / "checkpoints")
    return tmp_path / "run"


def _restore(cache_dir, run_dir, *extra):
    _, ckpt = _components(cache_dir, run_dir, *extra)
    try:
        return ckpt.restore()
    finally:
        dist.destroy_process_group()


def test_truncated_checkpoint_fails_clearly_or_falls_back(cache_dir, damaged):
    data = damaged / "checkpoints" / "step_000000020" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(
        CheckpointError, match=r"step_000000020: file __0_0.distcp is truncated.*checkpoint.fallback=true"
    ):
        _restore(cache_dir, damaged, "checkpoint.fallback=false")
    # A save that crashed half-way leaves only a .tmp- folder: ignored (and removed).
    (damaged / "checkpoints" / ".tmp-step_000000025").mkdir()
    assert _restore(cache_dir, damaged, "checkpoint.fallback=true").step == 15
    assert not (damaged / "checkpoints" / ".tmp-step_000000025").exists()


def test_corrupted_checkpoint_fails_clearly_or_falls_back(cache_dir, damaged):
    data = damaged / "checkpoints" / "step_000000020" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"step_000000020: file __0_0.distcp is corrupted \(CRC-32 mismatch\)"):
        _restore(cache_dir, damaged, "checkpoint.fallback=false")
    (damaged / "checkpoints" / "step_000000015" / "gem_checkpoint.json").unlink()
    assert _restore(cache_dir, damaged, "checkpoint.fallback=true").step == 10  # 20 corrupted, 15 incomplete


def test_incompatible_model_config_names_the_keys(cache_dir, damaged):
    with pytest.raises(
        CheckpointError, match=r"(?s)different model.*\[2000, 32\].*\[2000, 8\].*sparse.embedding_dim: 32 -> 8"
    ):
        _restore(cache_dir, damaged, "sparse.embedding_dim=8")


def test_a_checkpoint_without_a_lineage_id_loads_and_the_run_gets_one(cache_dir, tmp_path, monkeypatch):
    """A checkpoint written before gem recorded lineages (no ``lineage`` in DCP's state nor in the
    manifest) still loads; its lineage is unknown, and the resumed run's checkpoints get a new id.
    A fresh run's id is its own: another fresh start gets another one."""
    run = tmp_path / "run"
    _, ckpt = _components(cache_dir, run)
    try:
        state = ckpt._state
        monkeypatch.setattr(ckpt, "_state", lambda p: {k: v for k, v in state(p).items() if k != "lineage"})
        ckpt.save(Progress(step=3))
        first = ckpt.lineage
    finally:
        dist.destroy_process_group()
    old = run / "checkpoints" / "step_000000003"
    manifest = json.loads((old / "gem_checkpoint.json").read_text())
    (old / "gem_checkpoint.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "lineage"}))
    _, ckpt = _components(cache_dir, run)
    try:
        assert ckpt.restore().step == 3
        assert re.fullmatch("[0-9a-f]{32}", ckpt.lineage) and ckpt.lineage != first
        ckpt.save(Progress(step=4))
    finally:
        dist.destroy_process_group()
    assert _lineage(old) is None and _lineage(run / "checkpoints" / "step_000000004") == ckpt.lineage


def test_missing_checkpoint_directory(cache_dir, tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.load_from='/nonexistent/ckpt' does not exist"):
        _restore(cache_dir, tmp_path, "checkpoint.load_from=/nonexistent/ckpt")
    assert _restore(cache_dir, tmp_path / "fresh") is None  # resume with no checkpoint yet: start at step 0


def _intact(ckpt, directory: Path) -> list[str]:
    """The committed checkpoints in ``directory``, each verified (sizes and CRC-32) against its manifest."""
    expected = ckpt._fingerprint(ckpt._state(Progress()))
    assert all(ckpt._verify(p, expected) is None for p in list_checkpoints(directory))
    return [p.name for p in list_checkpoints(directory)]


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(cache_dir, damaged, monkeypatch):
    """Issue #27.4: a full disk gave `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected
    pos 704 vs 598` in a 98-line traceback. Checked before writing (shutil.disk_usage) and translated
    when the write itself fails; the partial folder goes, the earlier checkpoints stay."""
    import errno
    from collections import namedtuple
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    checkpoints = damaged / "checkpoints"
    _, ckpt = _components(cache_dir, damaged)
    try:
        assert ckpt.restore().step == 20
        before = _intact(ckpt, checkpoints)
        assert before == ["step_000000010", "step_000000015", "step_000000020"]
        usage = namedtuple("usage", "total used free")
        real_usage = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
        with pytest.raises(CheckpointError) as e:
            ckpt.save(Progress(step=25))
        message = str(e.value)
        assert re.search(
            r"step_000000025: no space left on device \(before writing\): the save needs about "
            r"[\d,]+ bytes \(\d+\.\d MiB\), .* has 4,096 bytes \(4\.0 KiB\) free\. Free space .*checkpoint.keep_last=3"
            r".*checkpoint.dir.*the previous checkpoint .*step_000000020 is intact",
            message,
        ), message
        needed = int(re.search(r"needs about ([\d,]+) bytes", message).group(1).replace(",", ""))
        assert needed > 4 * sum(p.numel() for p in ckpt.model.dense_arch.parameters())  # at least the fp32 weights
        assert _intact(ckpt, checkpoints) == before and not list(checkpoints.glob(".tmp-*"))

        monkeypatch.setattr(shutil, "disk_usage", real_usage)  # enough space, but the write fails half-way
        for failure in (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
            OSError(errno.ENOSPC, "No space left on device"),
        ):

            def full_disk(state, checkpoint_id, failure=failure, **kwargs):
                (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
                raise failure

            monkeypatch.setattr(dcp, "save", full_disk)
            with pytest.raises(
                CheckpointError,
                match=r"step_000000025: no space left on device \(while writing "
                r"\((RuntimeError|OSError).*\): the save needs about .* free",
            ) as e:
                ckpt.save(Progress(step=25))
            assert "Traceback" not in str(e.value) and e.value.__cause__ is None and e.value.__suppress_context__
            assert _intact(ckpt, checkpoints) == before and not list(checkpoints.glob(".tmp-*"))

        def full_disk_in_the_background(state, checkpoint_id, **kwargs):
            future = Future()
            future.set_exception(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
            return future

        monkeypatch.setattr(dcp, "async_save", full_disk_in_the_background)
        monkeypatch.setattr(ckpt.cfg, "async_save", True)
        ckpt.save(Progress(step=30))  # staged; the write fails in the background
        with pytest.raises(CheckpointError, match=r"step_000000030: no space left on device \(while writing"):
            ckpt.wait()
        assert _intact(ckpt, checkpoints) == before and not list(checkpoints.glob(".tmp-*"))
        monkeypatch.setattr(ckpt.cfg, "async_save", False)
        monkeypatch.setattr(dcp, "save", lambda *a, **k: (_ for _ in ()).throw(ValueError("not a disk problem")))
        with pytest.raises(ValueError, match="not a disk problem"):
            ckpt.save(Progress(step=25))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- GPU
# No CUDA FBGEMM on the GPU machines: TorchRec's sharded kernels cannot run there, so these use the
# native backend or unsharded TorchRec modules.


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", ["sparse=native", "sparse.shard=false"])
def test_resume_on_cuda_is_bit_identical(cache_dir, tmp_path, sparse):
    extra = ("trainer.device=cuda", sparse, "checkpoint.async_save=true")
    train(compose(_overrides(cache_dir, tmp_path / "full", *extra)))
    _interrupt(tmp_path / "full", tmp_path / "run", keep_through_step=10)
    train(compose(_overrides(cache_dir, tmp_path / "run", *extra)))
    expected, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "run")
    assert [resumed[s] for s in range(11, 21)] == [expected[s] for s in range(11, 21)]


@pytest.mark.multigpu
def test_resume_two_gpus_nccl_is_bit_identical(cache_dir, tmp_path):
    extra = ("trainer.device=cuda", "sparse=native", "checkpoint.async_save=true")
    _torchrun(cache_dir, tmp_path / "full", *extra)
    _interrupt(tmp_path / "full", tmp_path / "run", keep_through_step=10)
    _torchrun(cache_dir, tmp_path / "run", *extra)
    expected, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "run")
    assert [resumed[s] for s in range(11, 21)] == [expected[s] for s in range(11, 21)]


@pytest.mark.parametrize(
    "override, match",
    [
        ("checkpoint.verify=md5", "checkpoint.verify='md5' is not one of"),
        ("checkpoint.every_steps=-1", "checkpoint.every_steps=-1 must be >= 0"),
    ],
)
def test_checkpoint_config_is_validated(override, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        validate(compose([override]))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_checkpoints_the_step_and_the_rerun_loses_nothing(cache_dir, single_run, tmp_path, signum):
    """SIGTERM (a scheduler's preemption) or SIGINT arriving during step 7 of the uninterrupted run's
    command (checkpoints every 5): the step finishes, step_7 is written, train() raises Preempted
    (exit status 128 + the signal from ``python -m gem.train``); the rerun resumes at step 8 and
    steps 8-20 give the uninterrupted run's losses, bit for bit."""
    from gem.train.stopping import Preempted

    run_dir = tmp_path / "run"
    overrides = _overrides(cache_dir, run_dir, "optim.schedule=cosine", "optim.warmup_steps=3", "data.num_workers=1")

    def signal_at_7(step, rank, batch):
        if step == 7:
            os.kill(os.getpid(), signum)

    handler = signal.getsignal(signum)
    with pytest.raises(Preempted) as stopped:
        train(compose(overrides), hooks=[signal_at_7])
    assert stopped.value.step == 7 and stopped.value.exit_code == 128 + signum
    assert stopped.value.checkpoint == str(run_dir / "checkpoints" / "step_000000007")
    assert json.loads((run_dir / "checkpoints" / "step_000000007" / "gem_checkpoint.json").read_text())["step"] == 7
    assert signal.getsignal(signum) == handler and max(_losses(run_dir)) == 7  # handler back; step 7 logged
    train(compose(overrides))
    expected, resumed = _losses(single_run), _losses(run_dir)
    assert sorted(resumed) == list(range(1, 21))
    assert [resumed[s] for s in range(8, 21)] == [expected[s] for s in range(8, 21)]


def test_a_run_folder_holds_one_run_at_a_time(cache_dir, tmp_path):
    """A second run on a held trainer.run_dir stops at once with one line naming the folder and the
    holder; a lock file left by a dead run is taken over with a warning."""
    from gem.train.rundir import LOCK, RunDirInUse, RunDirLock

    run_dir = tmp_path / "run"
    with RunDirLock(run_dir):
        with pytest.raises(RunDirInUse, match=rf"trainer.run_dir='{run_dir}' is in use by another run \(pid \d+ on "):
            train(compose(_overrides(cache_dir, run_dir, "trainer.max_steps=2")))
    assert (run_dir / LOCK).read_text() == ""  # released
    assert not (run_dir / "metrics.jsonl").exists()  # nothing of the refused run written
    (run_dir / LOCK).write_text(json.dumps({"pid": 999999, "host": "gone", "time": 0.0, "argv": []}))
    train(compose(_overrides(cache_dir, run_dir, "trainer.max_steps=2")))
    assert (
        "took over the lock of a run that ended without releasing it (pid 999999 on gone"
        in (run_dir / "train.log").read_text()
    )
    file = tmp_path / "a_file"
    file.write_text("")
    with pytest.raises(ConfigError, match="is a file, or lies under one"):
        train(compose(_overrides(cache_dir, file, "trainer.max_steps=2")))
