"""Loader throughput: examples/s, ids/s and tokens/s of gem.data.pipeline.loader, in process and with workers,
plus the token imbalance across ranks with and without balancing.

    python benchmarks/data_loader.py [--rows 20000] [--workers 0 1 2] [--out benchmarks/results]

Two shapes, both from the synthetic generator (gem/data/sources/synthetic.py) with the default schema
(configs/data/synthetic.yaml: 5 id features, 4 per-event features, 8 dense, 2 tasks):

- ``quickstart``: histories up to 64 events (median ~16), batch 256, the embedded DLRM default;
- ``gem-base``: histories up to 1024 events, lognormal with median ~300, batch 1152 (the batch
  of the attention benchmark's gem-base shapes).

Writes ``<out>/data_loader-<hardware>.json`` with the date, git commit, hardware and versions.
Besides wall-clock rates it records CPU seconds (this process and its reaped workers), since
on a shared machine the wall clock mostly measures the other tenants.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.scaling import commit  # noqa: E402
from gem.data.format.layout import write_parquet  # noqa: E402
from gem.data.pipeline.balance import imbalance  # noqa: E402
from gem.data.pipeline.loader import build_loader  # noqa: E402
from gem.data.pipeline.schema import FeatureSchema  # noqa: E402
from gem.data.sources.synthetic import SyntheticConfig, generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "quickstart": {"max_len": 64, "batch_size": 256, "synthetic": SyntheticConfig()},
    "gem-base": {
        "max_len": 1024,
        "batch_size": 1152,
        "synthetic": SyntheticConfig(history_log_mean=math.log(300), history_log_std=0.8),
    },
}
# Measured GPU training step rates to compare with (examples/s); None where not measured yet.
GPU_STEP_RATES = {
    "quickstart": {"examples_per_s": 26000, "source": "README: DLRM quickstart, sparse=native, one H200"},
    "gem-base": {"examples_per_s": None, "source": "not known yet: no gem-base model / step benchmark exists"},
}


def schema_for(max_len: int) -> FeatureSchema:
    cfg = yaml.safe_load((ROOT / "configs/data/synthetic.yaml").read_text())["schema"]
    cfg["sequence_groups"][0]["max_len"] = max_len
    return FeatureSchema.from_config(cfg)


def write_data(directory: Path, schema: FeatureSchema, rows: int, cfg: SyntheticConfig) -> list[Path]:
    files = []
    per_file = max(1, rows // 4)
    for i, start in enumerate(range(0, rows, per_file)):
        table = generate(schema, min(per_file, rows - start), seed=i + 1, cfg=cfg)
        files.append(directory / f"part-{i:05d}.parquet")
        write_parquet(table, files[-1], schema, row_group_size=2048)
    return files


def epoch(files, schema, batch_size, num_workers, balance) -> dict:
    loader = build_loader(
        files, schema, batch_size, shuffle=True, seed=0, num_workers=num_workers, options={"balance": balance}
    )
    examples = ids = tokens = 0
    cpu_start = _cpu_seconds()
    start = time.perf_counter()
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        examples += batch.batch_size
        ids += batch.sparse.values().numel() + batch.sequences.values().numel()
        tokens += int(batch.sequences.lengths()[: batch.batch_size].sum())
    seconds = time.perf_counter() - start
    del loader  # workers exit and are reaped, so their CPU time is counted
    cpu = _cpu_seconds() - cpu_start
    return {
        "num_workers": num_workers,
        "balance": balance,
        "examples": examples,
        "seconds": seconds,
        "first_batch_s": first,
        "examples_per_s": examples / seconds,
        "ids_per_s": ids / seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_seconds": cpu,
        "examples_per_cpu_s": examples / cpu,
    }


def _cpu_seconds() -> float:
    """CPU time of this process and its reaped children (DataLoader workers): load-independent."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def rank_imbalance(files, schema, batch_size, world_size, balance) -> dict:
    per_rank = []
    for rank in range(world_size):
        loader = build_loader(
            files,
            schema,
            batch_size,
            shuffle=True,
            seed=0,
            drop_last=True,
            rank=rank,
            world_size=world_size,
            options={"balance": balance},
        )
        per_rank.append([int(b.sequences.lengths()[: b.batch_size].sum()) for b in loader])
    steps = min(map(len, per_rank))
    return imbalance(np.array([t[:steps] for t in per_rank]).T)


def versions() -> dict:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "git_commit": commit(),
        "hardware": f"{cpu}, {os.cpu_count()} cores",
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--world-size", type=int, default=8, help="simulated ranks for the imbalance figure")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {**versions(), "rows": args.rows, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            shape = SHAPES[name]
            schema = schema_for(shape["max_len"])
            directory = Path(tmp) / name
            files = write_data(directory, schema, args.rows, shape["synthetic"])
            epoch(files, schema, shape["batch_size"], 0, balance=True)  # warm-up: imports, page cache
            runs = [epoch(files, schema, shape["batch_size"], w, balance=True) for w in args.workers]
            runs.append(epoch(files, schema, shape["batch_size"], 0, balance=False))
            for r in runs:
                print(
                    f"{name:<10} workers={r['num_workers']} balance={r['balance']!s:<5} "
                    f"{r['examples_per_s']:>10,.0f} examples/s {r['ids_per_s'] / 1e6:>8.2f} M ids/s "
                    f"{r['tokens_per_s'] / 1e6:>8.2f} M tokens/s | "
                    f"{r['examples_per_cpu_s']:>10,.0f} examples per CPU-s",
                    flush=True,
                )
            batch = max(16, shape["batch_size"] // args.world_size)
            before = rank_imbalance(files, schema, batch, args.world_size, balance=False)
            after = rank_imbalance(files, schema, batch, args.world_size, balance=True)
            print(
                f"{name:<10} tokens per rank-step max/mean over {args.world_size} ranks, batch {batch}: "
                f"{before['max_over_mean_mean']:.3f} unbalanced -> {after['max_over_mean_mean']:.3f} balanced "
                f"(worst step {before['max_over_mean_worst']:.3f} -> {after['max_over_mean_worst']:.3f})"
            )
            best = max(r["examples_per_s"] for r in runs)
            gpu = GPU_STEP_RATES[name]
            result["shapes"][name] = {
                "max_len": shape["max_len"],
                "batch_size": shape["batch_size"],
                "mean_history": float(
                    np.mean(
                        [
                            pa.compute.list_value_length(t.column("hist_item")).to_numpy().mean()
                            for t in map(_read, files)
                        ]
                    )
                ),
                "runs": runs,
                "imbalance": {"per_rank_batch": batch, "unbalanced": before, "balanced": after},
                "gpu_step_rate": gpu,
                "loader_over_gpu": best / gpu["examples_per_s"] if gpu["examples_per_s"] else None,
            }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "cpu-" + "".join(c if c.isalnum() else "-" for c in result["hardware"].lower()).strip("-")
    path = out / f"data_loader-{slug}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def _read(path: Path) -> pa.Table:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["hist_item"])


if __name__ == "__main__":
    main()
