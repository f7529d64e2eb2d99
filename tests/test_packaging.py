"""The built wheel: it ships the Hydra config tree, and ``python -m gem.train`` runs from a directory
outside the checkout in a fresh environment where gem comes from the wheel alone.

No network and no reinstall of torch: the wheel is built with the current environment's setuptools
(``--no-build-isolation``) and installed with ``--no-deps`` into a fresh venv that sees this
environment's packages through a ``.pth`` line (the editable install of gem is not among them:
``.pth`` files of a directory added that way are not run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tests.conftest import ROOT

SOURCES = ("gem", "kernels", "configs", "setup.py", "pyproject.toml", "README.md")


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (wheel,) = out.glob("gem-*.whl")
    return wheel


def test_wheel_ships_configs_and_trains_from_any_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"gem/configs/{p.relative_to(ROOT / 'configs').as_posix()}" for p in (ROOT / "configs").rglob("*.yaml")}
    code = {p.relative_to(ROOT).as_posix() for top in ("gem", "kernels") for p in (ROOT / top).rglob("*.py")}
    assert "gem/configs/train.yaml" in names
    assert configs <= names, sorted(configs - names)
    assert code <= names, sorted(code - names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "outer.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch, torchrec, hydra, ...
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GEM_CACHE_DIR")}
    where = subprocess.run(
        [str(python), "-c", "import gem, gem.train.api as a; print(gem.__file__); print(a.config_dir())"],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where
    proc = subprocess.run(
        [str(python), "-m", "gem.train", "debug=tiny", "trainer.max_steps=3", "trainer.log_every=1"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_dir = work / "runs" / "debug_tiny"  # the defaults: runs/<name>, data under .cache/gem, both in the cwd
    assert (run_dir / "test_metrics.json").is_file() and (work / ".cache" / "gem").is_dir()
