"""Dense parameter count and analytic FLOPs per example of the gem_* model configs.

    python benchmarks/model_flops.py [--out benchmarks/results/model_flops.json]
    python benchmarks/model_flops.py --flagship   # -> benchmarks/results/model-flops-flagship.json

Builds each config's dense arch on the meta device over the synthetic schema
(configs/data/synthetic.yaml) and counts forward + backward FLOPs per example with
``GEMDenseArch.flops`` at a fixed history length (every example at that length, fill 1.0;
at fill 0.5 attention FLOPs fall by about 3x, the rest by 2x). No hardware is used.

``--flagship``: one training step of ``experiment=gem_base_h200`` for each block, at the batch and
history lengths of ``benchmarks/attention.py --flagship`` (1,024 examples, lognormal(5, 1) in
[1, 512]), split into the attention kernels' FLOPs (every ``gem.models.sequence.attention_flops``
term: self-attention, the personalized FFN's GDPA, pooling) and the rest (the projections' GEMMs),
for the rate of each kind against a profile's device time (docs/e2e.md, "What 40% takes").
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import torch
from hydra.utils import instantiate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.attention import FLAGSHIP_BATCH, flagship_lengths  # noqa: E402
from benchmarks.scaling import commit  # noqa: E402
from gem.data.pipeline.schema import FeatureSchema  # noqa: E402
from gem.models import sequence  # noqa: E402
from gem.sparse.arch import SparseArch  # noqa: E402
from gem.train.api import compose  # noqa: E402

# config -> (sparse.embedding_dim, history length used for the FLOP figure)
SIZES = {"gem_tiny": (32, 64), "gem_base": (128, 512), "gem_large": (256, 1024)}


def dense_arch(overrides: list[str], embedding_dim: int | None = None):
    """(dense arch on the meta device, schema) of a composed config; ``embedding_dim`` replaces the
    config's ``sparse.embedding_dim``."""
    cfg = compose(overrides)
    schema = FeatureSchema.from_config(cfg.data.schema)
    dim = embedding_dim or cfg.sparse.embedding_dim
    sparse = SparseArch.from_config(schema, dim, backend="native", device="meta")
    feature_dims = {f: sparse.pooled_dim(f) for f in schema.id_feature_names}
    feature_dims |= {g.name: sparse.sequence_dim(g.name) for g in schema.sequence_groups}
    with torch.device("meta"):
        dense = instantiate(cfg.model, _partial_=True, _convert_="all")(schema=schema, feature_dims=feature_dims)
    return dense, schema


def measure(model: str, block: str, embedding_dim: int, length: int, batch_size: int = 64) -> dict:
    dense, schema = dense_arch([f"model={model}", f"model.block={block}"], embedding_dim)
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


def flagship_split(block: str) -> dict:
    """One training step of experiment=gem_base_h200 at the flagship's lengths: FLOPs in all and in
    the attention kernels (each attention term counted as the model counts it, forward and
    backward)."""
    dense, schema = dense_arch(["experiment=gem_base_h200", f"model.block={block}"])
    lengths = flagship_lengths()
    terms = []
    count = sequence.attention_flops

    def counted(*args):
        terms.append(count(*args))
        return terms[-1]

    with mock.patch.object(sequence, "attention_flops", counted):
        flops = dense.flops(FLAGSHIP_BATCH, {g.name: lengths for g in schema.sequence_groups})
    train = flops["forward"] + flops["backward"]
    attention = 3 * sum(terms)  # the backward counts twice the forward (GEMDenseArch.flops)
    return {
        "block": block,
        "train_flops": train,
        "attention_flops": attention,
        "attention_share": attention / train,
        "mean_length": float(lengths.double().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--out",
        help="the JSON (default: model_flops.json, or model-flops-flagship.json, in benchmarks/results)",
    )
    parser.add_argument("--flagship", action="store_true", help="the flagship's FLOPs: attention and the rest")
    args = parser.parse_args()
    if args.flagship:
        rows = [flagship_split(block) for block in ("interformer", "kunlun")]
        for r in rows:
            print(
                f"{r['block']:12} {r['train_flops'] / 1e12:6.2f} TFLOP a step, attention "
                f"{r['attention_flops'] / 1e12:5.2f} ({100 * r['attention_share']:.1f}%)"
            )
        write(args.out or ROOT / "benchmarks/results/model-flops-flagship.json", rows)
        return
    rows = [measure(m, b, *SIZES[m]) for m in SIZES for b in ("interformer", "kunlun")]
    print(f"{'model':10} {'block':12} {'emb':>4} {'L':>5} {'dense params':>13} {'fwd+bwd FLOP/example':>21}")
    for r in rows:
        print(
            f"{r['model']:10} {r['block']:12} {r['sparse.embedding_dim']:4d} {r['history_length']:5d} "
            f"{r['dense_params'] / 1e6:12.2f}M {r['train_flops_per_example'] / 1e9:20.3f}G"
        )
    write(args.out or ROOT / "benchmarks/results/model_flops.json", rows)


def write(path, rows: list[dict]) -> None:
    record = {
        "date": datetime.now(timezone.utc).isoformat(),
        "git_commit": commit(),
        "hardware": "none (analytic, meta device)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
