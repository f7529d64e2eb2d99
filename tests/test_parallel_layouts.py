"""Every data-parallel layout trains every dense arch on two gloo ranks, each with its own dtypes.

Each option of configs/parallelism/ (found in the folder, so a new option is covered) x GEM's
InterFormer and Kunlun blocks (gem_tiny) and the DLRM baseline trains a few steps of ``debug=tiny``
under torchrun, as ``python -m gem.train parallelism=<option> ...`` would, and must end without an
error and log finite losses. The options' own ``param_dtype`` is kept (bfloat16 for fsdp, hsdp and
replicate): when FSDP2 cast the rotary tables handed into each GEM block to it, every bf16 layout
failed for both blocks (``cos must be float32, got torch.bfloat16``) and no test ran one.

All cases share one torchrun (tests/parallel_layouts_worker.py calls ``train()`` once per case): a
torchrun start costs seconds of imports per rank, a case a second or two. With 2 ranks on one node,
``hsdp`` resolves to the 1-D FSDP mesh (dp_shard = the node's 2 ranks) and ``replicate`` to the 2-D
mesh (2, 1). The README's torchrun line runs too, as written (its run directory in a temporary folder).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, compose
from tests.test_distributed import _errors, torchrun

OPTIONS = sorted(p.stem for p in (ROOT / "configs" / "parallelism").glob("*.yaml"))
MODELS = {
    "interformer": ["model=gem_tiny", "model.block=interformer"],
    "kunlun": ["model=gem_tiny", "model.block=kunlun"],
    "dlrm": ["model=dlrm"],
}
CASES = {f"{option}-{model}": (option, model) for option in OPTIONS for model in MODELS}
STEPS = 3
COMMON = [
    "debug=tiny",
    "trainer.device=cpu",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=1",
    "trainer.eval_max_batches=1",
    "trainer.plots=false",
]
TIMEOUT_S = 240  # the one torchrun of every case: ~30 s on 2 idle cores
README_TIMEOUT_S = 120  # README's torchrun line: ~15 s


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """The debug=tiny data set, generated once for the module."""
    return tmp_path_factory.mktemp("cache")


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, cache_dir) -> tuple[Path, str]:
    """Every case in one torchrun of 2 ranks: (the output folder, what went wrong with the torchrun or "")."""
    out = tmp_path_factory.mktemp("layouts")
    cases = [{"name": name, "overrides": [f"parallelism={o}", *MODELS[m]]} for name, (o, m) in CASES.items()]
    args = ["tests/parallel_layouts_worker.py", "--out", str(out), "--cases", json.dumps(cases)]
    try:
        proc = torchrun([*args, "--", *COMMON, f"data.cache_dir={cache_dir}"], nproc=2, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return out, f"the torchrun did not end within {TIMEOUT_S} s:\n{_errors(_text(e.stderr))}"
    return out, "" if proc.returncode == 0 else f"the torchrun exited {proc.returncode}:\n{_errors(proc.stderr)}"


def test_one_torchrun_trains_every_case(layouts):
    """The worker exits 0 only when every case trained on every rank."""
    _, problem = layouts
    assert not problem, problem


@pytest.mark.parametrize("case", CASES)
def test_layout_trains_with_finite_losses(case, layouts):
    out, problem = layouts
    option, model = CASES[case]
    what = f"parallelism={option} with {' '.join(MODELS[model])}"
    results = {}
    for rank in range(2):
        path = out / "results" / f"{case}.rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else None
    errors = {r: res["error"] for r, res in results.items() if res is not None and not res["ok"]}
    missing = [r for r, res in results.items() if res is None]
    errors |= {r: "never finished the case (the torchrun ended or hung before)" for r in missing}
    if errors:
        first = min((r for r in errors if r not in missing), default=None)
        message = f"{what} failed:\n" + "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
        message += f"\n\nrank {first}'s traceback:\n{results[first]['traceback']}" if first is not None else ""
        pytest.fail(message + (f"\n\n{problem}" if missing else ""), pytrace=False)
    run_dir = out / case
    losses = _losses(run_dir)
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), f"{what}: train losses {losses}"
    # the option's own compute dtype (bfloat16 for fsdp, hsdp, replicate) was the one that ran
    dtype = compose(["debug=tiny", f"parallelism={option}"]).parallelism.param_dtype
    log = (run_dir / "train.log").read_text()
    assert "world size 2" in log and f"compute {dtype}, " in log, f"{what}: {log[-2000:]}"


def test_readme_torchrun_line_runs_on_cpu(cache_dir, tmp_path, monkeypatch):
    """README's Quickstart ``torchrun ...`` line, as written, on 2 CPU ranks; only its run directory (the
    default or ``trainer.run_dir``) moves to a temporary folder (torchrun on a free port; the data set in
    the module's cache folder, through GEM_CACHE_DIR, which the line does not set)."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("torchrun ")]
    assert len(lines) == 1, f"README.md should have one line starting with `torchrun `, found {lines}"
    words = shlex.split(lines[0], comments=True)[1:]
    nproc = [w for w in words if re.fullmatch(r"--nproc[_-]per[_-]node=\d+", w)]
    assert len(nproc) == 1, f"README's torchrun line should set --nproc_per_node=N: {lines[0]}"
    run_dir = tmp_path / "run"
    args = [w for w in words if w not in nproc and not w.startswith("trainer.run_dir=")]
    monkeypatch.setenv("GEM_CACHE_DIR", str(cache_dir))
    proc = torchrun([*args, f"trainer.run_dir={run_dir}"], nproc=int(nproc[0].split("=")[1]), timeout=README_TIMEOUT_S)
    assert proc.returncode == 0, f"README's `{lines[0]}` exited {proc.returncode}:\n{_errors(proc.stderr)}"
    losses = _losses(run_dir)
    assert losses and all(math.isfinite(x) for x in losses), losses
