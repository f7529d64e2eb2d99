"""Triton kernels against the padded PyTorch reference through 30 float32 gem_base training steps.

    python benchmarks/trajectories.py [--block interformer] [--out benchmarks/results/trajectories-h200.json]

Runs ``tests.test_gem_models.gem_base_trajectory`` (experiment=gem_base_h200's shapes, float32, eager,
same weights and batches) with each backend, under the flagship recipe and under the old one
(AdamW 2e-3, no warm-up), and writes the per-step losses and their relative difference: how much a
difference of one float32 rounding grows in training. Needs a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import environment  # noqa: E402
from tests.test_gem_models import gem_base_trajectory  # noqa: E402

RECIPES = {"flagship": (), "old": ("optim.dense.lr=0.002", "optim.warmup_steps=0", "optim.schedule=constant")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", default="interformer")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trajectories-h200.json"))
    args = parser.parse_args()
    results = {}
    for recipe, overrides in RECIPES.items():
        with tempfile.TemporaryDirectory() as cache:
            losses = {
                backend: gem_base_trajectory(backend, args.block, cache, overrides=overrides)
                for backend in ("triton", "reference")
            }
        diff = [abs(a - b) / abs(b) for a, b in zip(losses["triton"], losses["reference"])]
        results[recipe] = losses | {"rel_diff": diff, "overrides": list(overrides)}
        print(f"{recipe}: relative difference per step", " ".join(f"{x:.1e}" for x in diff), flush=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "benchmark": "trajectories",
                "block": args.block,
                "dtype": "float32",
                "date": datetime.datetime.now(datetime.UTC).isoformat(),
                **environment(),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
