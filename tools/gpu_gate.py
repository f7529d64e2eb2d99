"""The GPU gate's report (tools/gpu_gate.sh runs it in two parts, each in a device call):

    python tools/gpu_gate.py summarize WORK --part tests|flagship -o OUT/gpu-gate-<part>.json
    python tools/gpu_gate.py merge tests.json flagship.json -o benchmarks/results/gpu-gate.json

``WORK`` holds, per test phase, ``<phase>.xml`` (pytest's JUnit XML), ``<phase>.txt`` (its log, a
line per test), ``<phase>.rc`` (its exit status) and ``<phase>.seconds`` (its wall time), and per
flagship run ``runs/<block>/`` (the run folder), ``<block>.rc`` and ``<block>.seconds``. The
seconds, and each phase's slowest tests, say where a part's time went (the device calls' limit).
A phase cut by its time limit leaves no XML: its tests are then read from the log, and it is
marked ``cut``. A part passes when each of its test phases exited 0 with at least one test passed
and none failed, and (the flagship part) every flagship run exited 0, trained its steps, wrote
test metrics and fell back to no slower kernel; the gate passes when both parts of one commit do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"tests": ("kernels", "gpu_tier"), "flagship": ("kernels_alone",)}  # each part's test phases
BLOCKS = ("interformer", "kunlun")
# pytest -v's outcome lines: "tests/a.py::t[x] PASSED [ 5%]", with xdist "[gw0] [ 5%] PASSED tests/a.py::t[x]"
_WORD, _NAME = r"(PASSED|FAILED|ERROR|SKIPPED)", r"(tests/\S+::\S+)"
_OUTCOME = re.compile(rf"\b{_WORD} {_NAME}|{_NAME} {_WORD}\b")


def _integer(path: Path) -> int | None:
    """The exit status or seconds a phase or run wrote, None where it never finished (cut by the
    call's limit)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


SLOWEST = 10  # tests named with their seconds in each phase's record


def tests(xml_path: Path, log_path: Path | None = None) -> dict:
    """Test names by outcome from one JUnit XML file (``file::test[params]``), under ``reasons``
    the first line of each failure's message and under ``slowest`` the SLOWEST longest tests with
    their seconds; without the XML (a phase cut by its limit), from the pytest log ``log_path``,
    marked ``cut``."""
    outcome: dict = {"passed": [], "failed": [], "skipped": [], "reasons": {}}
    if not xml_path.exists():
        return outcome | _logged(log_path) | {"cut": True}
    seconds = {}
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}"
        seconds[name] = float(case.get("time") or 0.0)
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failure is not None:
            outcome["failed"].append(name)
            lines = (failure.get("message") or failure.text or "").strip().splitlines()
            outcome["reasons"][name] = lines[0][:300] if lines else ""
        elif case.find("skipped") is not None:
            outcome["skipped"].append(name)
        else:
            outcome["passed"].append(name)
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST]
    outcome["slowest"] = {name: round(time, 1) for name, time in slowest}
    return outcome


def _logged(log_path: Path | None) -> dict:
    """Test names by outcome from the ``-v`` lines of a pytest log (the last outcome of each)."""
    last: dict[str, str] = {}
    if log_path is not None and log_path.exists():
        for match in _OUTCOME.finditer(log_path.read_text(errors="replace")):
            word, name = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
            last[name] = word
    kinds = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped"}
    outcome: dict = {"passed": [], "failed": [], "skipped": []}
    for name, word in sorted(last.items()):
        outcome[kinds[word]].append(name)
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


def summarize(work: Path, part: str, environment: dict | None = None) -> dict:
    """One part's record (``tests`` or ``flagship``) from the folder ``work``."""
    if environment is None:
        sys.path.insert(0, str(ROOT))
        from benchmarks.scaling import environment as read_environment

        environment = read_environment()
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "part": part}
    report |= environment
    problems = []
    report["tests"] = {
        phase: {
            "rc": _integer(work / f"{phase}.rc"),
            "seconds": _integer(work / f"{phase}.seconds"),
            **tests(work / f"{phase}.xml", work / f"{phase}.txt"),
        }
        for phase in PARTS[part]
    }
    for phase, record in report["tests"].items():
        if record["rc"] != 0 or record["failed"] or not record["passed"]:
            cut = " (cut: read from its log)" if record.get("cut") else ""
            problems.append(
                f"{phase}: rc {record['rc']}, {len(record['failed'])} failed, {len(record['passed'])} passed{cut}"
            )
    if part == "flagship":
        report["flagship"] = {
            block: flagship(work / "runs" / block, _integer(work / f"{block}.rc"))
            | {"seconds": _integer(work / f"{block}.seconds")}
            for block in BLOCKS
        }
        for block, record in report["flagship"].items():
            if record["rc"] != 0 or record["test_click_auc"] is None or record["fallbacks"]:
                problems.append(
                    f"flagship {block}: rc {record['rc']}, test AUC {record['test_click_auc']}, "
                    f"{len(record['fallbacks'])} fallback(s)"
                )
    report["passed"] = not problems
    report["problems"] = problems
    return report


def merge(parts: list[dict]) -> dict:
    """The gate's record from its parts' (one commit): each part's sections, and passed when all did."""
    commits = {p.get("commit") for p in parts}
    if len(commits) != 1:
        raise SystemExit(f"the parts ran at different commits: {sorted(map(str, commits))}")
    skip = ("tests", "flagship", "passed", "problems", "part")
    report = {k: v for k, v in parts[0].items() if k not in skip}
    report["tests"] = {phase: record for p in parts for phase, record in p.get("tests", {}).items()}
    flagship = [p["flagship"] for p in parts if "flagship" in p]
    if flagship:
        report["flagship"] = flagship[-1]
    missing = [k for k in PARTS if k not in {p.get("part") for p in parts}]
    report["problems"] = [x for p in parts for x in p["problems"]] + [f"no {k} part" for k in missing]
    report["passed"] = not report["problems"]
    report["hardware_by_part"] = {p.get("part"): p.get("hardware") for p in parts}
    return report


def _verdict(report: dict) -> str:
    verdict = "PASSED" if report["passed"] else "FAILED: " + "; ".join(report["problems"])
    lines = [f"GPU gate at {report.get('commit')}: {verdict}"]
    for block, record in report.get("flagship", {}).items():
        lines.append(
            f"  {block}: rc {record['rc']}, {record['steps']} steps, {record['examples_per_s']} examples/s, "
            f"MFU {record['mfu']}, test click AUC {record['test_click_auc']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("summarize", help="one part's record from the folder tools/gpu_gate.sh wrote")
    one.add_argument("work", type=Path)
    one.add_argument("--part", choices=["tests", "flagship"], required=True)
    one.add_argument("-o", "--out", type=Path, required=True)
    both = sub.add_parser("merge", help="the gate's record from its parts' JSON files")
    both.add_argument("parts", type=Path, nargs="+")
    both.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "summarize":
        report = summarize(args.work, args.part)
    else:
        report = merge([json.loads(p.read_text()) for p in args.parts])
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(_verdict(report))


if __name__ == "__main__":
    main()
