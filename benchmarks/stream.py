"""Streaming (#29.4): progressive AUC per day on a synthetic stream whose ids renew and whose
interests drift, for three ways of fitting raw ids into fixed tables (sparse.ids).

    python benchmarks/stream.py [--days 7] [--examples-per-day 8000] [--lifetime 4] [--drift 0.1] \\
        [--out benchmarks/results/stream-cpu.json]

The stream is ``experiment=stream``'s (gem/data/sources/stream.py): every user and item takes a new
raw id in [0, 2**40) every ``--lifetime`` days, each at its own phase, so over the stream there are
several raw ids per table row; the item latents drift by ``--drift`` a day. Each day is scored
before the model trains on it (progressive evaluation), so day ``d``'s AUC is the AUC of the model
trained on days ``1..d-1``. The variants map the three renewed features' raw ids to rows by:

- ``mch_lru``: managed collisions (TorchRec's MCH), the least recently seen id evicted for a new one;
- ``mch_no_eviction``: managed collisions without eviction: once a table is full, new ids share its
  last row;
- ``modulo``: ``raw id % rows``, a fixed table that wraps ids;
- ``no_new_ids``: the reference, the same stream without renewed ids (each user and item keeps one id).

Same seed, data and model (DLRM, the default synthetic schema) for all three; one process on CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.scaling import commit  # noqa: E402

TABLES = ("t_user_id", "t_ad_id", "t_hist_item")
VARIANTS = {
    "mch_lru": {"policy": "mch", "eviction": "lru", "eviction_interval": 5},
    "mch_no_eviction": {"policy": "mch", "eviction": "none", "eviction_interval": 5},
    "modulo": {"policy": "modulo"},
    "no_new_ids": {"policy": "modulo"},  # the reference: ids never renewed (every id < its table's rows)
}


def overrides(args, name: str, work: Path) -> list[str]:
    mapping = VARIANTS[name]
    ids = [f"++sparse.ids.{t}.{k}={v}" for t in TABLES for k, v in mapping.items()]
    return [
        "experiment=stream",
        f"data.stream.days={args.days}",
        f"data.stream.examples_per_day={args.examples_per_day}",
        f"data.stream.id_lifetime_days={0 if name == 'no_new_ids' else args.lifetime}",
        f"data.stream.drift_per_day={args.drift}",
        f"data.cache_dir={work / 'cache'}",
        f"trainer.run_dir={work / name}",
        "checkpoint.enabled=false",
        "trainer.delta_export.every=null",
        "trainer.progress_bar=false",
        "trainer.plots=false",
        f"trainer.seed={args.seed}",
        f"data.seed={args.seed}",
        f"data.synthetic.num_clusters={args.clusters}",
        *ids,
    ]


def configure(args, name: str, work: Path):
    """The composed config, with the catalogue sizes of ``--users`` / ``--items`` rows (tables small
    enough that every row is trained often, so what a row holds matters)."""
    from gem.train.api import compose

    cfg = compose(overrides(args, name, work))
    rows = {"user_id": args.users, "ad_id": args.items, "hist_item": args.items}
    for f in [*cfg.data.schema.id_features, *(f for g in cfg.data.schema.sequence_groups for f in g.features)]:
        f.cardinality = rows.get(f.name, f.cardinality)
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--examples-per-day", type=int, default=8000)
    parser.add_argument("--lifetime", type=float, default=4.0, help="days between a user's / item's raw ids")
    parser.add_argument("--drift", type=float, default=0.1, help="interest drift per day")
    parser.add_argument("--users", type=int, default=500, help="rows of the user table (and users in the world)")
    parser.add_argument("--items", type=int, default=1000, help="rows of the ad and history item tables")
    parser.add_argument(
        "--clusters",
        type=int,
        default=2,
        help="interest clusters: few, so that the click signal is in each item's own latent (its id)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-stream")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stream-cpu.json")
    args = parser.parse_args()

    from gem.train.trainer import train

    results, seconds = {}, {}
    for name in VARIANTS:
        tick = time.perf_counter()
        train(configure(args, name, args.work))
        seconds[name] = time.perf_counter() - tick
        per_day = json.loads((args.work / name / "stream_metrics.json").read_text())["partitions"]
        results[name] = {
            day: {k: v[k] for k in ("click/auc", "click/ne", "conversion/auc")} for day, v in per_day.items()
        }
        log = [json.loads(line) for line in (args.work / name / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in log if r["kind"] == "train"][-1]
        results[name]["_ids"] = {k: v for k, v in last.items() if k.startswith("ids/")}

    days = sorted(d for d in results["mch_lru"] if not d.startswith("_"))
    mean_after_first = {n: sum(results[n][d]["click/auc"] for d in days[1:]) / max(1, len(days) - 1) for n in VARIANTS}
    out = {
        "benchmark": "stream",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit(),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "metric": "progressive click AUC: each day scored before training on it",
        "per_day": results,
        "mean_click_auc_days_2_on": mean_after_first,
        "seconds": seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{'day':14s} " + " ".join(f"{n:>16s}" for n in VARIANTS))
    for d in days:
        print(f"{d:14s} " + " ".join(f"{results[n][d]['click/auc']:16.4f}" for n in VARIANTS))
    print(f"{'mean, day 2+':14s} " + " ".join(f"{mean_after_first[n]:16.4f}" for n in VARIANTS))
    print(f"seconds: {seconds}; {args.out}")


if __name__ == "__main__":
    main()
