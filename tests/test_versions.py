"""The check of torch / FBGEMM / TorchRec / Triton versions (gem/versions.py), on faked versions."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import warnings

import pytest

from gem import versions
from tests.conftest import ROOT

CPU_PINS = {"torch": "2.13.0+cpu", "fbgemm-gpu-cpu": "1.8.0", "torchrec": "1.8.0", "triton": "3.7.1"}
H200 = {"torch": "2.11.0+cu130", "fbgemm-gpu": "1.6.0", "torchrec": "1.6.1", "triton": "3.6.0"}


@pytest.fixture
def fake(monkeypatch):
    """Install ``dists`` (name -> version) as what importlib.metadata reports; others are absent."""

    def install(dists: dict[str, str]) -> None:
        def version(name: str) -> str:
            if name not in dists:
                raise importlib.metadata.PackageNotFoundError(name)
            return dists[name]

        monkeypatch.setattr(importlib.metadata, "version", version)
        versions.ensure_versions.cache_clear()

    yield install
    versions.ensure_versions.cache_clear()


def test_the_known_good_combinations_pass(fake):
    for dists in (
        CPU_PINS,
        H200,
        H200 | {"fbgemm-gpu": None} | {"fbgemm-gpu-cpu": "1.6.0"},
        CPU_PINS | {"fbgemm-gpu": "1.8.0"},
    ):  # the CUDA wheel installed over the CPU one
        fake({k: v for k, v in dists.items() if v})
        assert versions.check_versions() is None, dists
    fake(CPU_PINS | {"torch": "2.13.1+cpu", "triton": "3.7.0"})  # patch releases do not matter
    assert versions.check_versions() is None
    fake({k: v for k, v in CPU_PINS.items() if k != "triton"} | {"pytorch-triton": "3.7.1"})  # torch nightlies' name
    assert versions.installed()["triton"] == "3.7.1" and versions.check_versions() is None


def test_fbgemm_built_for_another_torch_names_the_versions_and_what_to_install(fake):
    fake(CPU_PINS | {"torch": "2.12.0+cpu"})
    with pytest.raises(versions.VersionError) as e:
        versions.check_versions()
    msg = str(e.value)
    assert "fbgemm-gpu-cpu 1.8.0 is built for torch 2.13, not 2.12.0+cpu" in msg
    assert "installed: torch 2.12.0+cpu, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0, triton 3.7.1" in msg
    assert "pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0 triton==3.7.1" in msg and "GEM_SKIP_VERSION_CHECK=1" in msg


def test_torchrec_fbgemm_and_triton_mismatches_suggest_the_set_of_the_installed_torch(fake):
    fake(H200 | {"torchrec": "1.8.0", "triton": "3.7.1"})
    with pytest.raises(versions.VersionError) as e:
        versions.check_versions()
    msg = str(e.value)
    assert "torchrec 1.8.0 pairs with FBGEMM 1.8, not fbgemm-gpu 1.6.0" in msg
    assert "torch 2.11.0+cu130 was tested with triton 3.6, not 3.7.1" in msg
    assert "fbgemm-gpu==1.6.0 torchrec==1.6.1 triton==3.6.0" in msg  # the CUDA build, for torch 2.11


def test_a_missing_package_fails_and_an_untested_consistent_set_warns(fake):
    fake({"torch": "2.13.0"})
    with pytest.raises(versions.VersionError, match="fbgemm-gpu is not installed; torchrec is not installed"):
        versions.check_versions()
    fake({"torch": "2.14.0", "fbgemm-gpu": "1.9.0", "torchrec": "1.9.0", "triton": "3.8.0"})
    with pytest.warns(UserWarning, match=r"not been tested with torch 2.14.0, fbgemm-gpu 1.9.0.*pairing rules hold"):
        versions.ensure_versions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.ensure_versions()  # once per process


def test_the_override_skips_the_check(fake, monkeypatch):
    fake(CPU_PINS | {"torchrec": "1.6.1"})
    with pytest.raises(versions.VersionError):
        versions.ensure_versions()
    monkeypatch.setenv("GEM_SKIP_VERSION_CHECK", "1")
    versions.ensure_versions()


def test_python_m_gem_train_prints_the_version_error_as_one_line(tmp_path):
    code = (
        "import importlib.metadata as md, runpy, sys\n"
        "real = md.version\n"
        "md.version = lambda name: '2.12.0+cpu' if name == 'torch' else real(name)\n"
        "runpy.run_module('gem.train', run_name='__main__', alter_sys=True)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "GEM_SKIP_VERSION_CHECK")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "Error in the installed packages: these versions do not work together: "
        "fbgemm-gpu-cpu 1.8.0 is built for torch 2.13, not 2.12.0+cpu"
    ), proc.stderr


def test_benchmarks_record_the_commit_of_their_own_checkout_only(tmp_path, monkeypatch):
    """benchmarks' provenance: HEAD of the checkout whose top level the tree is (``+modified`` when its
    tracked files differ, as in a copy whose ``.git`` is older than its files); a copy inside another
    checkout (a ``git archive`` snapshot) has no commit of its own unless ``$GIT_COMMIT`` names it."""
    from benchmarks.scaling import commit

    if shutil.which("git") is None:
        pytest.skip("needs git")
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("a")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.txt"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    assert commit(tmp_path) == head.strip()
    (tmp_path / "a.txt").write_text("b")  # a tracked file changed: the tree is not HEAD's
    assert commit(tmp_path) == head.strip() + "+modified"
    assert commit(snapshot) is None
    monkeypatch.setenv("GIT_COMMIT", "abc123")
    assert commit(snapshot) == "abc123"
