"""Embedding table configs derived from the feature schema and the ``sparse`` config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gem.data.pipeline.schema import FeatureSchema, check_names


@dataclass(frozen=True)
class TableSpec:
    """One embedding table and the features that look it up.

    ``pooled`` tables serve only id features and live in TorchRec's EmbeddingBagCollection
    (sum-pooled bags). Every other table lives in the EmbeddingCollection (one row per id):
    those serve sequence features, and also id features that share a table with a sequence
    feature (the SparseArch sum-pools their rows).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooled: bool
    init_scale: float

    @property
    def num_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * 4


def table_name(table: str) -> str:
    return f"t_{table}"


def build_tables(
    schema: FeatureSchema,
    embedding_dim: int,
    init_scale: float,
    dims: Mapping[str, int] | None = None,
) -> list[TableSpec]:
    """One table per distinct ``table`` of the schema's features; ``dims`` overrides ``embedding_dim``
    per feature (``sparse.dims``; features sharing a table must agree)."""
    dims = dict(dims or {})
    check_names(schema, list(dims), "sparse.dims")
    if embedding_dim < 1 or any(d < 1 for d in dims.values()):
        raise ValueError(f"sparse.embedding_dim and sparse.dims must be >= 1, got {embedding_dim} and {dims}")
    features = list(schema.id_features) + [f for g in schema.sequence_groups for f in g.features]
    sequence_features = set(schema.sequence_feature_names)
    tables: dict[str, list] = {}
    for f in features:
        tables.setdefault(f.table_name, []).append(f)
    specs = []
    for table, members in tables.items():
        widths = {dims.get(f.name, embedding_dim) for f in members}
        if len(widths) > 1:
            raise ValueError(
                f"sparse.dims: features {[f.name for f in members]} share table {table!r} but ask for "
                f"widths {sorted(widths)}; give them one width"
            )
        pooled = not any(f.name in sequence_features for f in members)
        specs.append(
            TableSpec(
                table_name(table),
                members[0].cardinality,
                widths.pop(),
                tuple(f.name for f in members),
                pooled,
                init_scale,
            )
        )
    ec_dims = {t.embedding_dim for t in specs if not t.pooled}
    if len(ec_dims) > 1:
        raise ValueError(
            f"sparse.dims: every sequence feature (and every id feature sharing a table with one) needs the same "
            f"width, since TorchRec's EmbeddingCollection has one embedding_dim; got {sorted(ec_dims)}. Override only "
            "the widths of id features with tables of their own in sparse.dims"
        )
    return specs
