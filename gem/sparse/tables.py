"""Embedding table configs derived from the feature schema and the ``sparse`` config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from gem.data.schema import FeatureSchema, check_names


@dataclass(frozen=True)
class TableSpec:
    """One embedding table. ``pooled`` tables serve id features (sum-pooled bags), the others
    serve per-event sequence features (one row per event)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooled: bool
    init_scale: float

    @property
    def num_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * 4


def table_name(feature: str) -> str:
    return f"t_{feature}"


def build_tables(
    schema: FeatureSchema,
    embedding_dim: int,
    init_scale: float,
    dims: Mapping[str, int] | None = None,
) -> list[TableSpec]:
    """One table per feature; ``dims`` overrides ``embedding_dim`` per feature (``sparse.dims``)."""
    dims = dict(dims or {})
    check_names(schema, list(dims), "sparse.dims")
    if embedding_dim < 1 or any(d < 1 for d in dims.values()):
        raise ValueError(f"sparse.embedding_dim and sparse.dims must be >= 1, got {embedding_dim} and {dims}")
    seq_dims = {dims.get(n, embedding_dim) for n in schema.sequence_feature_names}
    if len(seq_dims) > 1:
        raise ValueError(
            f"sparse.dims: every sequence feature needs the same width (TorchRec's EmbeddingCollection has one "
            f"embedding_dim), got {sorted(seq_dims)}; override only id features in sparse.dims"
        )
    specs = []
    for f in schema.id_features:
        specs.append(TableSpec(table_name(f.name), f.cardinality, dims.get(f.name, embedding_dim), (f.name,), True, init_scale))
    for g in schema.sequence_groups:
        for f in g.features:
            specs.append(TableSpec(table_name(f.name), f.cardinality, dims.get(f.name, embedding_dim), (f.name,), False, init_scale))
    return specs
