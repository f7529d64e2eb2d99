"""Dense parameter count and analytic FLOPs per example of the gem_* model configs.

    python benchmarks/model_flops.py [--out benchmarks/results/model_flops.json]

Builds each config's dense arch on the meta device over the synthetic schema
(configs/data/synthetic.yaml) and counts forward + backward FLOPs per example with
``GEMDenseArch.flops`` at a fixed history length (every example at that length, fill 1.0;
at fill 0.5 attention FLOPs fall by about 3x, the rest by 2x). No hardware is used.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from hydra.utils import instantiate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.scaling import commit  # noqa: E402
from gem.data.pipeline.schema import FeatureSchema  # noqa: E402
from gem.sparse.arch import SparseArch  # noqa: E402
from gem.train.api import compose  # noqa: E402

# config -> (sparse.embedding_dim, history length used for the FLOP figure)
SIZES = {"gem_tiny": (32, 64), "gem_base": (128, 512), "gem_large": (256, 1024)}


def measure(model: str, block: str, embedding_dim: int, length: int, batch_size: int = 64) -> dict:
    cfg = compose([f"model={model}", f"model.block={block}"])
    schema = FeatureSchema.from_config(cfg.data.schema)
    sparse = SparseArch.from_config(schema, embedding_dim, backend="native", device="meta")
    feature_dims = {f: sparse.pooled_dim(f) for f in schema.id_feature_names}
    feature_dims |= {g.name: sparse.sequence_dim(g.name) for g in schema.sequence_groups}
    with torch.device("meta"):
        dense = instantiate(cfg.model, _partial_=True, _convert_="all")(schema=schema, feature_dims=feature_dims)
    lengths = {g.name: torch.full((batch_size,), length) for g in schema.sequence_groups}
    flops = dense.flops(batch_size, lengths)
    return {
        "model": model,
        "block": block,
        "sparse.embedding_dim": embedding_dim,
        "history_length": length,
        "dense_params": sum(p.numel() for p in dense.parameters()),
        "forward_flops_per_example": flops["forward"] / batch_size,
        "train_flops_per_example": (flops["forward"] + flops["backward"]) / batch_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/model_flops.json"))
    args = parser.parse_args()
    rows = [measure(m, b, *SIZES[m]) for m in SIZES for b in ("interformer", "kunlun")]
    print(f"{'model':10} {'block':12} {'emb':>4} {'L':>5} {'dense params':>13} {'fwd+bwd FLOP/example':>21}")
    for r in rows:
        print(
            f"{r['model']:10} {r['block']:12} {r['sparse.embedding_dim']:4d} {r['history_length']:5d} "
            f"{r['dense_params'] / 1e6:12.2f}M {r['train_flops_per_example'] / 1e9:20.3f}G"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(),
                "git_commit": commit(),
                "hardware": "none (analytic, meta device)",
                "torch": torch.__version__,
                "python": platform.python_version(),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
