"""Data-parallel scaling: examples/s of the trainer on 1 and N devices with the same per-device batch.

Launches ``torchrun --nproc_per_node=n -m gem.train <overrides>`` once per ``n`` in ``--nproc``,
reads each run's metrics.jsonl, and takes the median examples/s over the logged windows after
the first ``--skip`` (warm-up, compile, allocator growth). Efficiency of ``n`` devices is
``examples_per_s(n) / (n * examples_per_s(1))``. Prints a table and writes
``benchmarks/results/scaling-<hardware>.json`` (date, commit, hardware, versions, overrides, figures).

Two H200s, native tables (no CUDA fbgemm needed), bf16 FSDP2 dense::

    python benchmarks/scaling.py --nproc 1,2 -- trainer.device=cuda sparse=native parallelism=fsdp \\
        data.batch_size=4096 data.num_workers=4 data.num_examples.train=2000000 trainer.max_steps=300
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(nproc: int, overrides: list[str], run_dir: Path, skip: int) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "-m",
        "gem.train",
        *overrides,
        f"trainer.run_dir={run_dir}",
        "trainer.progress_bar=false",
        "trainer.eval_max_batches=1",
    ]
    print("$", " ".join(cmd), flush=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # keep the caller's too
    subprocess.run(cmd, cwd=ROOT, check=True, env=os.environ | {"PYTHONPATH": path})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if r["kind"] == "train"][skip:]
    if not windows:
        raise SystemExit(
            f"{run_dir}: no training window after skipping {skip}; raise trainer.max_steps or lower trainer.log_every"
        )
    return {
        "nproc": nproc,
        "examples_per_s": statistics.median(r["examples_per_s"] for r in windows),
        "step_ms": statistics.median(r["step_ms"] for r in windows),
        "data_wait_frac": statistics.median(r["data_wait_frac"] for r in windows),
        "mfu": statistics.median(r["mfu"] for r in windows) if all(r.get("mfu") is not None for r in windows) else None,
        "windows": len(windows),
        "final_loss": windows[-1]["loss"],
    }


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for name in ("triton", "torchrec", "fbgemm_gpu"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # not installed, or fails to load without its CUDA build
            info[name] = None
    if torch.cuda.is_available():
        info["hardware"] = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    else:
        info["hardware"] = f"cpu ({os.cpu_count()} cores)"
    info["commit"] = commit()
    return info


def commit(root: Path = ROOT) -> str | None:
    """The commit of the tree at ``root``: ``$GIT_COMMIT`` if set (for a copy of the tree, such as a
    ``git archive`` snapshot), else ``HEAD`` of the checkout whose top level ``root`` is, with
    ``+modified`` where tracked files differ from it (uncommitted edits, or a copied tree whose
    ``.git`` is older than its files, as on a lent GPU machine); None for a tree that is not a
    checkout, rather than the commit of a repository that merely contains it."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        top, head = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.split()
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        changed = subprocess.run(status, cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None
    if Path(top).resolve() != Path(root).resolve():
        return None
    return f"{head}+modified" if changed else head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", default="1,2", help="comma-separated process counts; the first is the baseline")
    parser.add_argument("--skip", type=int, default=2, help="logged windows to drop as warm-up")
    parser.add_argument("--out-dir", default=str(ROOT / "runs" / "scaling"))
    parser.add_argument("--tag", default=None, help="file name suffix (default: the hardware, slugged)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    counts = [int(n) for n in args.nproc.split(",")]
    env = environment()
    results = [run(n, args.overrides, Path(args.out_dir) / f"n{n}", args.skip) for n in counts]
    base = results[0]
    for r in results:
        r["speedup"] = r["examples_per_s"] / base["examples_per_s"]
        r["efficiency"] = r["speedup"] * base["nproc"] / r["nproc"]
    print(
        f"\n{'nproc':>5}  {'examples/s':>12}  {'step ms':>8}  {'data wait':>9}  {'MFU':>6}  {'speedup':>7}  "
        f"{'efficiency':>10}"
    )
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(
            f"{r['nproc']:>5}  {r['examples_per_s']:>12.0f}  {r['step_ms']:>8.2f}  {r['data_wait_frac']:>9.3f}  "
            f"{mfu:>6}  {r['speedup']:>7.2f}  {r['efficiency']:>10.1%}"
        )
    tag = args.tag or "".join(c if c.isalnum() else "-" for c in env["hardware"].lower()).strip("-")
    out = ROOT / "benchmarks" / "results" / f"scaling-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "scaling",
                "date": datetime.datetime.now(datetime.UTC).isoformat(),
                **env,
                "per_device_batch": "same for every run (data.batch_size)",
                "overrides": args.overrides,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
