"""The GPU gate's report: ``python tools/gpu_gate.py summarize OUT`` reads what ``tools/gpu_gate.sh``
left in ``OUT`` and writes ``OUT/gpu-gate.json``; copy it to ``benchmarks/results/gpu-gate.json``.

``OUT`` holds, per test phase, ``<phase>.xml`` (pytest's JUnit XML) and ``<phase>.rc`` (its exit
status), and per flagship run ``runs/<block>/`` (the run folder) and ``<block>.rc``. The gate passes
when every phase exited 0 with at least one test passed and none failed, and every flagship run
exited 0, trained its steps, wrote test metrics and fell back to no slower kernel.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_PHASES = ("kernels", "gpu_tier")
BLOCKS = ("interformer", "kunlun")


def _exit_code(path: Path) -> int | None:
    """The exit status a phase wrote, None where it never finished (cut by the call's limit)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def tests(xml_path: Path) -> dict:
    """Test names by outcome from one JUnit XML file (``file::test[params]``)."""
    outcome: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    if not xml_path.exists():
        return outcome | {"missing": True}
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome["failed"].append(name)
        elif case.find("skipped") is not None:
            outcome["skipped"].append(name)
        else:
            outcome["passed"].append(name)
    return outcome


def flagship(run_dir: Path, rc: int | None, warmup_windows: int = 1) -> dict:
    """One flagship run: exit status, steps, the median of its logged windows after the first
    ``warmup_windows`` (examples/s, MFU), the test click AUC and any kernel fallbacks."""
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    timed = train[warmup_windows:] or train
    result: dict = {"rc": rc, "steps": train[-1]["step"] if train else 0}
    for key in ("examples_per_s", "mfu", "step_ms"):
        values = [r[key] for r in timed if key in r]
        result[key] = statistics.median(values) if values else None
    test = run_dir / "test_metrics.json"
    result["test_click_auc"] = json.loads(test.read_text()).get("click/auc") if test.exists() else None
    result["fallbacks"] = [r for r in rows if r.get("kind") == "fallback"]
    return result


def summarize(out: Path, environment: dict | None = None) -> dict:
    """The gate's record from the folder ``out`` (see the module docstring)."""
    if environment is None:
        sys.path.insert(0, str(ROOT))
        from benchmarks.scaling import environment as read_environment

        environment = read_environment()
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    report |= environment
    report["tests"] = {
        phase: {"rc": _exit_code(out / f"{phase}.rc"), **tests(out / f"{phase}.xml")} for phase in TEST_PHASES
    }
    report["flagship"] = {block: flagship(out / "runs" / block, _exit_code(out / f"{block}.rc")) for block in BLOCKS}
    problems = []
    for phase, record in report["tests"].items():
        if record["rc"] != 0 or record["failed"] or not record["passed"]:
            problems.append(
                f"{phase}: rc {record['rc']}, {len(record['failed'])} failed, {len(record['passed'])} passed"
            )
    for block, record in report["flagship"].items():
        if record["rc"] != 0 or record["test_click_auc"] is None or record["fallbacks"]:
            problems.append(
                f"flagship {block}: rc {record['rc']}, test AUC {record['test_click_auc']}, "
                f"{len(record['fallbacks'])} fallback(s)"
            )
    report["passed"] = not problems
    report["problems"] = problems
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["summarize"])
    parser.add_argument("out", type=Path, help="the folder tools/gpu_gate.sh wrote")
    args = parser.parse_args()
    report = summarize(args.out)
    (args.out / "gpu-gate.json").write_text(json.dumps(report, indent=1) + "\n")
    verdict = "PASSED" if report["passed"] else "FAILED: " + "; ".join(report["problems"])
    print(f"GPU gate at {report.get('commit')}: {verdict}")
    for block, record in report["flagship"].items():
        print(
            f"  {block}: rc {record['rc']}, {record['steps']} steps, {record['examples_per_s']} examples/s, "
            f"MFU {record['mfu']}, test click AUC {record['test_click_auc']}"
        )


if __name__ == "__main__":
    main()
