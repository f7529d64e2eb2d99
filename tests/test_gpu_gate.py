"""tools/gpu_gate.py reads what tools/gpu_gate.sh leaves (JUnit XML, exit codes, run folders) and
decides: the parsing and the verdict, on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.gpu_gate import merge, summarize

ROOT = Path(__file__).resolve().parents[1]

ENV = {"commit": "abc", "hardware": "1x NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0"}


def _junit(path, cases):
    """cases: (classname, name, outcome[, seconds]) with outcome passed | failure | error | skipped."""
    body = "".join(
        f'<testcase classname="{c}" name="{n}" time="{(t or [1.0])[0]}">'
        + ("" if o == "passed" else f'<{o} message="why">x</{o}>')
        + "</testcase>"
        for c, n, o, *t in cases
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')


def _tests_work(tmp_path, kernel_outcome="passed", rc=0):
    _junit(
        tmp_path / "kernels.xml",
        [
            ("tests.kernels.test_jagged_attention", "test_gpu_gluon_forward[silu-jagged]", kernel_outcome),
            ("tests.kernels.test_jagged_attention", "test_gpu_real_shapes[silu-64]", "passed"),
            ("tests.kernels.test_rotary", "test_gpu_rotary", "skipped"),
        ],
    )
    _junit(tmp_path / "gpu_tier.xml", [("tests.test_train", "test_trainer_on_cuda[sparse=native]", "passed")])
    for phase, code in (("kernels", rc), ("gpu_tier", 0)):
        (tmp_path / f"{phase}.rc").write_text(f"{code}\n")
    return tmp_path


def _flagship_work(tmp_path, fallback=False):
    tmp_path.mkdir(exist_ok=True)
    alone = [("tests.kernels.test_jagged_attention", "test_gpu_gluon_forward_many_tiles[dtype0-64]", "passed")]
    _junit(tmp_path / "kernels_alone.xml", alone)
    (tmp_path / "kernels_alone.rc").write_text("0\n")
    for block, rc in (("interformer", 0), ("kunlun", 0)):
        run = tmp_path / "runs" / block
        run.mkdir(parents=True)
        rows = [{"kind": "startup", "step": 0}]
        rows += [{"kind": "train", "step": s, "examples_per_s": 100.0 * s, "mfu": 0.01 * s} for s in (20, 40, 60)]
        if fallback and block == "kunlun":
            rows.append({"kind": "fallback", "step": 1, "kernel": "gluon_fwd", "to": "triton"})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "test_metrics.json").write_text(json.dumps({"click/auc": 0.8}))
        (tmp_path / f"{block}.rc").write_text(f"{rc}\n")
    return tmp_path


def test_the_tests_part_lists_every_test_by_outcome(tmp_path):
    report = summarize(_tests_work(tmp_path), "tests", ENV)
    kernels = report["tests"]["kernels"]
    assert kernels["passed"] == [
        "tests/kernels/test_jagged_attention.py::test_gpu_gluon_forward[silu-jagged]",
        "tests/kernels/test_jagged_attention.py::test_gpu_real_shapes[silu-64]",
    ]
    assert kernels["skipped"] == ["tests/kernels/test_rotary.py::test_gpu_rotary"] and kernels["rc"] == 0
    assert report["passed"] and report["commit"] == "abc" and report["hardware"].startswith("1x NVIDIA")


@pytest.mark.parametrize("outcome, rc", [("failure", 1), ("error", 1), ("passed", 124)])
def test_a_failed_test_or_a_cut_phase_fails_the_part(tmp_path, outcome, rc):
    report = summarize(_tests_work(tmp_path, outcome, rc), "tests", ENV)
    assert not report["passed"] and report["problems"][0].startswith(f"kernels: rc {rc}")
    name = "tests/kernels/test_jagged_attention.py::test_gpu_gluon_forward[silu-jagged]"
    assert report["tests"]["kernels"]["reasons"] == ({name: "why"} if outcome != "passed" else {})


def test_a_phase_cut_before_its_junit_file_is_read_from_its_log(tmp_path):
    """A phase the limit cut leaves no XML: its tests come from pytest -v's lines (xdist's and
    plain ones, the last outcome of each), and it fails the part."""
    _tests_work(tmp_path)
    (tmp_path / "kernels.xml").unlink()
    (tmp_path / "kernels.rc").write_text("124\n")
    (tmp_path / "kernels.txt").write_text(
        "WARNING:root: noise\n"
        "[gw0] [ 10%] PASSED tests/kernels/test_a.py::test_gpu_x[silu-64] \n"
        "[gw1] [ 20%] FAILED tests/kernels/test_a.py::test_gpu_y \n"
        "tests/kernels/test_b.py::test_gpu_z SKIPPED (needs sm_90)       [ 30%]\n"
        "tests/kernels/test_b.py::test_gpu_w PASSED                      [ 40%]\n"
    )
    report = summarize(tmp_path, "tests", ENV)
    kernels = report["tests"]["kernels"]
    assert kernels["cut"] and kernels["rc"] == 124
    assert kernels["passed"] == ["tests/kernels/test_a.py::test_gpu_x[silu-64]", "tests/kernels/test_b.py::test_gpu_w"]
    assert kernels["failed"] == ["tests/kernels/test_a.py::test_gpu_y"]
    assert kernels["skipped"] == ["tests/kernels/test_b.py::test_gpu_z"]
    assert not report["passed"]
    assert report["problems"] == ["kernels: rc 124, 1 failed, 2 passed (cut: read from its log)"]


def test_a_phase_without_junit_file_or_log_fails_the_part(tmp_path):
    (tmp_path / "kernels.rc").write_text("124\n")
    report = summarize(tmp_path, "tests", ENV)
    assert not report["passed"] and report["tests"]["kernels"]["cut"] and report["tests"]["kernels"]["passed"] == []


def test_each_phase_and_run_reports_its_seconds_and_its_slowest_tests(tmp_path):
    _junit(
        tmp_path / "kernels.xml",
        [("tests.kernels.test_a", f"test_gpu_{i}", "passed", float(i)) for i in range(12)],
    )
    (tmp_path / "kernels.rc").write_text("0\n")
    (tmp_path / "kernels.seconds").write_text("412\n")
    kernels = summarize(tmp_path, "tests", ENV)["tests"]["kernels"]
    assert kernels["seconds"] == 412
    assert list(kernels["slowest"].items())[:2] == [
        ("tests/kernels/test_a.py::test_gpu_11", 11.0),
        ("tests/kernels/test_a.py::test_gpu_10", 10.0),
    ]
    assert len(kernels["slowest"]) == 10
    work = _flagship_work(tmp_path / "flagship")
    (work / "kunlun.seconds").write_text("187\n")
    runs = summarize(work, "flagship", ENV)["flagship"]
    assert (runs["kunlun"]["seconds"], runs["interformer"]["seconds"]) == (187, None)  # None: never finished


def test_flagship_part_takes_the_windows_after_the_first(tmp_path):
    report = summarize(_flagship_work(tmp_path), "flagship", ENV)
    run = report["flagship"]["interformer"]
    assert run["steps"] == 60 and run["examples_per_s"] == 5000.0 and run["mfu"] == pytest.approx(0.5)
    assert run["test_click_auc"] == 0.8 and run["fallbacks"] == [] and report["passed"]
    assert list(report["tests"]) == ["kernels_alone"] and report["tests"]["kernels_alone"]["passed"]


def test_the_many_tiles_tests_fail_the_flagship_part(tmp_path):
    work = _flagship_work(tmp_path)
    (work / "kernels_alone.rc").write_text("1\n")
    report = summarize(work, "flagship", ENV)
    assert not report["passed"] and report["problems"][0].startswith("kernels_alone: rc 1")


def test_a_kernel_fallback_fails_the_flagship_part(tmp_path):
    report = summarize(_flagship_work(tmp_path, fallback=True), "flagship", ENV)
    assert not report["passed"] and "flagship kunlun" in report["problems"][0]


def test_merge_needs_both_parts_of_one_commit(tmp_path):
    (tmp_path / "t").mkdir()
    tests = summarize(_tests_work(tmp_path / "t"), "tests", ENV)
    flagship = summarize(_flagship_work(tmp_path / "f"), "flagship", ENV)
    gate = merge([tests, flagship])
    assert gate["passed"] and set(gate) >= {"tests", "flagship", "commit", "hardware"}
    assert list(gate["tests"]) == ["kernels", "gpu_tier", "kernels_alone"]
    assert gate["hardware_by_part"] == {"tests": ENV["hardware"], "flagship": ENV["hardware"]}
    assert not merge([tests])["passed"] and merge([tests])["problems"] == ["no flagship part"]
    with pytest.raises(SystemExit, match="different commits"):
        merge([tests, flagship | {"commit": "def"}])


@pytest.mark.parametrize("part", ["tests", "flagship"])
def test_the_gate_script_writes_its_record_before_the_calls_limit(tmp_path, part):
    """tools/gpu_gate.sh cuts every phase and run to end before GATE_SECONDS, counted from its start:
    with pytest and the training runs standing still (a stand-in python), the part's JSON is still
    written in time, its phases cut and the runs that had no time left not started."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    for name in ("gpu_gate.sh", "gpu_gate.py"):
        shutil.copy(ROOT / "tools" / name, root / "tools" / name)
    (root / "benchmarks").symlink_to(ROOT / "benchmarks")
    (root / "tools" / "gpu_env.sh").write_text(f'export PYTHONPATH="{ROOT}"\n')  # (no wheels to install)
    stand_in = tmp_path / "bin" / "python"
    stand_in.parent.mkdir()
    stand_in.write_text(
        f'#!/bin/sh\ncase "$*" in *"-m pytest"*|*"-m gem.train"*) exec sleep 600;; esac\nexec {sys.executable} "$@"\n'
    )
    stand_in.chmod(0o755)
    limit = 38  # seconds: the script keeps 30 for the summary, so its phases get about 8
    env = os.environ | {
        "PATH": f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}",
        "GATE_SECONDS": str(limit),
        "GIT_COMMIT": "abc",
        "OUT": str(tmp_path / "out"),
        "GATE_WORK": str(tmp_path / "work"),
    }
    start = time.monotonic()
    subprocess.run(["bash", "tools/gpu_gate.sh", part], cwd=root, env=env, capture_output=True, timeout=300)
    assert time.monotonic() - start < limit
    report = json.loads((tmp_path / "out" / f"gpu-gate-{part}.json").read_text())
    assert report["commit"] == "abc" and not report["passed"]
    for phase, record in report["tests"].items():
        assert record["rc"] == 124 and record["cut"], phase
    if part == "flagship":
        assert [record["rc"] for record in report["flagship"].values()] == [124, 124]
        assert "not started" in (tmp_path / "work" / "kunlun.txt").read_text()
