"""Calibrate gem.plan's step-time model on this CPU with gloo trainings, and report its error on them.

    python benchmarks/plan_cpu.py [--repeats 3] [--skip 2] [--profile]

1. Measures the machine (gem/plan/machine.py: one-thread matmul and copy rates with one and two
   processes at once, gloo all-to-all latency and bandwidth between two processes).
2. Trains each run of gem/plan/cpu_calibration.py ``RUNS`` ``--repeats`` times, one at a time
   (``torchrun --nproc_per_node 1`` or ``2 -m gem.train ...``, gloo, TorchRec-sharded tables,
   10-30 s each), taking the median over the logged windows after the first ``--skip``
   (warm-up), then over repeats; the spread (min, max over repeats) is kept. Before each
   training the matmul and copy rates are measured again with as many processes as it has ranks
   (the host is shared: its load drifts, and each training records the load average), and the run
   is predicted with them. ``--profile``: one more training of each run under the profiler (rank
   0), its time by model part.
3. Fits ``plan.mfu``, ``plan.embedding_efficiency`` and ``plan.step_overhead_ms`` on the one-rank
   runs marked ``fit`` and predicts the others; prints the table and writes
   ``benchmarks/results/plan_model-cpu.json`` (hardware, versions, commit, every measurement).

``--refit`` skips 1-2 and fits again from the measurements in that file (after a model change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import environment  # noqa: E402
from gem.plan import cpu_calibration  # noqa: E402
from gem.plan.machine import CPUMachine, concurrent_rates, measure_cpu  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "plan_model-cpu.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_once(run: cpu_calibration.CPURun, run_dir: Path, cache: Path, skip: int, extra: tuple = ()) -> dict:
    """One training of ``run``: median step ms less data wait, and examples/s, over windows after ``skip``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={run.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "-m",
        "gem.train",
        *cpu_calibration.train_overrides(run),
        f"trainer.run_dir={run_dir}",
        f"data.cache_dir={cache}",
        "trainer.progress_bar=false",
        "trainer.eval_max_batches=1",
        *extra,
    ]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]  # the host's 1-minute load average (other users' jobs share its cores)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise SystemExit(f"{run.label}: training failed\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if r["kind"] == "train"][skip:]
    if not windows:
        raise SystemExit(f"{run.label}: no window after skipping {skip}")
    return {
        "step_ms": statistics.median(r["step_ms"] * (1 - r["data_wait_frac"]) for r in windows),
        "step_ms_with_data": statistics.median(r["step_ms"] for r in windows),
        "examples_per_s": statistics.median(r["examples_per_s"] for r in windows),
        "windows": len(windows),
        "load_average": [load, os.getloadavg()[0]],  # before and after
    }


def rates_now(nproc: int) -> dict[str, float]:
    """The host's per-rank matmul and copy rates with ``nproc`` processes at once, measured now."""
    r = concurrent_rates(nproc, threads=1, repeats=9)
    return {k: statistics.median(v) for k, v in r.items()}


def profiled(run: cpu_calibration.CPURun, out_dir: Path, cache: Path) -> dict:
    """One more training of ``run`` under the profiler (6 steps near the end): ms per step by model part."""
    start = run.steps - 7
    extra = (f"trainer.profile.start={start}", "trainer.profile.steps=6", "trainer.profile.top=2000")
    train_once(run, out_dir, cache, 0, extra)
    b = json.loads((out_dir / "profile" / "breakdown_rank0.json").read_text())
    return {"ms_per_step": b["ms_per_step"], "parts_ms": cpu_calibration.profile_parts(b["top"])}


def measure_runs(repeats: int, skip: int, out_dir: Path, profile: bool) -> list[dict]:
    """Every run ``repeats`` times, the host's rates measured before each (the load drifts)."""
    results = []
    for run in cpu_calibration.RUNS:
        reps = []
        for i in range(repeats):
            rates = rates_now(run.nproc)
            reps.append(train_once(run, out_dir / f"r{i}", out_dir / "cache", skip) | {"rates": rates})
        ms = [r["step_ms"] for r in reps]
        results.append(
            {
                "run": run.label,
                "nproc": run.nproc,
                "overrides": cpu_calibration.train_overrides(run),
                "fit": run.fit,
                "step_ms": statistics.median(ms),
                "step_ms_spread": [min(ms), max(ms)],
                "step_ms_with_data": statistics.median(r["step_ms_with_data"] for r in reps),
                "examples_per_s": statistics.median(r["examples_per_s"] for r in reps),
                "rates": {k: statistics.median(r["rates"][k] for r in reps) for k in reps[0]["rates"]},
                "repeats": reps,
            }
        )
        if profile:
            results[-1]["profile"] = profiled(run, out_dir / "profiled", out_dir / "cache")
        print(f"{run.label:<55} {results[-1]['step_ms']:8.2f} ms  ({min(ms):.2f}-{max(ms):.2f})", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", type=int, default=2, help="logged windows to drop as warm-up")
    parser.add_argument("--out-dir", default=str(ROOT / "runs" / "plan_cpu"))
    parser.add_argument("--refit", action="store_true", help="fit again from the measurements in " + OUT.name)
    parser.add_argument("--profile", action="store_true", help="one profiled training more per run")
    parser.add_argument("--tag", default=None, help="write plan_model-cpu-<tag>.json (e.g. another load)")
    args = parser.parse_args()
    out_path = OUT.with_name(f"{OUT.stem}-{args.tag}.json") if args.tag else OUT
    if args.refit:
        old = json.loads(out_path.read_text())
        env, machine, runs = old["environment"], CPUMachine(**old["machine"]), old["runs"]
    else:
        env = environment() | {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        machine = measure_cpu(threads=1)
        for n in (1, 2):
            print(f"machine, {n} ranks at once: " + " ".join(machine.overrides(n)), flush=True)
        runs = measure_runs(args.repeats, args.skip, Path(args.out_dir), args.profile)
        after = measure_cpu(threads=1)  # the host's load drifts: the same figures after the runs, for the record
    fitted, checks, parts = cpu_calibration.fit(
        {r["run"]: r["step_ms"] for r in runs}, machine, {r["run"]: r["rates"] for r in runs}
    )
    print("fitted: " + ", ".join(f"plan.{k}={v:.4g}" for k, v in fitted.items()))
    print(f"{'run':<55} {'measured ms':>11} {'predicted ms':>12} {'error':>7}  fitted")
    for c in checks:
        print(f"{c.run:<55} {c.measured_ms:>11.2f} {c.predicted_ms:>12.2f} {c.error:>+7.1%}  {c.fitted or ''}")
    for r in runs:
        if "profile" in r:
            p = parts[r["run"]]
            print(f"{r['run']}: profiled {r['profile']['ms_per_step']:.1f} ms a step by part (predicted):")
            print(
                "  "
                + ", ".join(
                    f"{k} {v:.1f}" + (f" ({p[k]:.1f})" if k in p else "") for k, v in r["profile"]["parts_ms"].items()
                )
            )
    held_out = [abs(c.error) for c in checks if not c.fitted]
    print(f"held-out runs: mean |error| {statistics.mean(held_out):.1%}, max {max(held_out):.1%}")
    out = {
        "benchmark": "plan_model-cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "commit": env.get("commit"),
        "hardware": f"{env.get('cores')}-core CPU ({env.get('cpu')}), shared; one thread per rank, gloo loopback",
        "environment": env,
        "machine": machine.to_json(),
        "machine_after_runs": after.to_json() if not args.refit else old.get("machine_after_runs"),
        "notes": "step_ms: the trainer's step less its data wait, median over windows, then repeats; rates: "
        "the per-rank matmul / copy rates measured before each repeat with as many processes as ranks; "
        "load_average: the host's 1-minute load before and after each training; profile: one more "
        "training under torch.profiler, rank 0, ms per step by model part (cpu_calibration.profile_parts; "
        "profiled steps run longer than unprofiled ones)",
        "plan_overrides": {n: machine.overrides(n) + [f"plan.{k}={v:.6g}" for k, v in fitted.items()] for n in (1, 2)},
        "fitted": fitted,
        "runs": runs,
        "checks": [
            {
                "run": c.run,
                "measured_ms": c.measured_ms,
                "predicted_ms": c.predicted_ms,
                "error": c.error,
                "fitted": c.fitted,
                "predicted_parts_ms": parts[c.run],
            }
            for c in checks
        ],
    }
    if args.refit:  # the measurements' date, commit and notes stay; the fit's are added
        out |= {k: old[k] for k in ("date", "commit", "notes") if k in old}
        out["refit"] = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "commit": environment()["commit"]}
        out = {k: out[k] for k in ("benchmark", "date", "commit", "notes", "refit") if k in out} | out
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
