"""Run hygiene: CPU threads against the CPUs really available, loggers (JSON lines, TensorBoard),
curves, one-line configuration errors, empty evaluation splits, and metrics rows after a resume."""

from __future__ import annotations

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
