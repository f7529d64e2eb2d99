"""The feature schema: what a data set holds and how big each id space is.

A schema is data, not code: it comes from the ``data`` config group and is shared by the
generator, the Parquet reader, the sparse arch and the heads, so that a name mismatch is
caught once, at start-up, with a message that names the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class IdFeature:
    """A pooled categorical feature (user id, ad id, context ...), multi-hot up to ``max_ids`` ids.

    ``table`` names the embedding table (default: the feature's own name); features naming the
    same table share it, e.g. the candidate ad's item id and the history's item ids.
    """

    name: str
    cardinality: int
    max_ids: int = 1
    table: str | None = None

    @property
    def table_name(self) -> str:
        return self.table or self.name


@dataclass(frozen=True)
class SequenceFeature:
    """One per-event id of an event stream (item id, action type, surface, time-gap bucket ...).

    ``table`` as for :class:`IdFeature`.
    """

    name: str
    cardinality: int
    table: str | None = None

    @property
    def table_name(self) -> str:
        return self.table or self.name


@dataclass(frozen=True)
class SequenceGroup:
    """An event stream: its per-event features share lengths; histories keep the ``max_len`` most recent events."""

    name: str
    features: tuple[SequenceFeature, ...]
    max_len: int

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]


@dataclass(frozen=True)
class FeatureSchema:
    id_features: tuple[IdFeature, ...]
    sequence_groups: tuple[SequenceGroup, ...]
    num_dense: int
    tasks: tuple[str, ...]
    num_domains: int = 1

    def __post_init__(self) -> None:
        names = [f.name for f in self.id_features] + [f.name for g in self.sequence_groups for f in g.features]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"data.schema: feature names must be unique, repeated: {dup}")
        for n in names + [g.name for g in self.sequence_groups]:
            if not n.isidentifier():
                raise ValueError(
                    f"data.schema: feature / group name {n!r} must be a Python identifier (letters, digits, _)"
                )
        for f in self.id_features:
            if f.cardinality < 1 or f.max_ids < 1:
                raise ValueError(f"data.schema.id_features.{f.name}: cardinality and max_ids must be >= 1")
        for g in self.sequence_groups:
            if g.max_len < 1 or not g.features:
                raise ValueError(f"data.schema.sequence_groups.{g.name}: needs max_len >= 1 and at least one feature")
            for f in g.features:
                if f.cardinality < 1:
                    raise ValueError(
                        f"data.schema.sequence_groups.{g.name}.features.{f.name}: cardinality must be >= 1"
                    )
        cardinality: dict[str, tuple[str, int]] = {}
        for f in list(self.id_features) + [f for g in self.sequence_groups for f in g.features]:
            first = cardinality.setdefault(f.table_name, (f.name, f.cardinality))
            if first[1] != f.cardinality:
                raise ValueError(
                    f"data.schema: features {first[0]!r} and {f.name!r} share table {f.table_name!r} but have "
                    f"cardinalities {first[1]} and {f.cardinality}; give them the same cardinality"
                )
            if not f.table_name.isidentifier():
                raise ValueError(f"data.schema: table name {f.table_name!r} of {f.name!r} must be a Python identifier")
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"data.schema.tasks: need at least one task and unique names, got {list(self.tasks)}")
        if self.num_dense < 0 or self.num_domains < 1:
            raise ValueError("data.schema: num_dense must be >= 0 and num_domains >= 1")

    # -- lookups -----------------------------------------------------------------------------
    @property
    def id_feature_names(self) -> list[str]:
        return [f.name for f in self.id_features]

    @property
    def sequence_feature_names(self) -> list[str]:
        """All per-event features, group by group, in KJT key order."""
        return [f.name for g in self.sequence_groups for f in g.features]

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def cardinality(self, feature: str) -> int:
        return self.feature(feature).cardinality

    def group(self, name: str) -> SequenceGroup:
        for g in self.sequence_groups:
            if g.name == name:
                return g
        raise KeyError(f"unknown sequence group {name!r}; the schema has {[g.name for g in self.sequence_groups]}")

    def unknown_feature_message(self, feature: str, where: str = "") -> str:
        known = self.id_feature_names + self.sequence_feature_names
        return f"{where + ': ' if where else ''}unknown feature {feature!r}; the schema (data.schema) defines {known}"

    # -- config ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> FeatureSchema:
        """Build from the ``data.schema`` config node (plain dicts / lists, as in configs/data/*.yaml)."""
        try:
            return cls(
                id_features=tuple(IdFeature(**f) for f in cfg["id_features"]),
                sequence_groups=tuple(
                    SequenceGroup(
                        name=g["name"],
                        max_len=int(g["max_len"]),
                        features=tuple(SequenceFeature(**f) for f in g["features"]),
                    )
                    for g in cfg.get("sequence_groups", [])
                ),
                num_dense=int(cfg["num_dense"]),
                tasks=tuple(cfg["tasks"]),
                num_domains=int(cfg.get("num_domains", 1)),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"data.schema: malformed schema ({e}); see configs/data/synthetic.yaml for the expected form"
            ) from e

    def feature(self, name: str) -> IdFeature | SequenceFeature:
        for f in list(self.id_features) + [f for g in self.sequence_groups for f in g.features]:
            if f.name == name:
                return f
        raise KeyError(self.unknown_feature_message(name))

    def to_config(self) -> dict[str, Any]:
        def plain(f) -> dict[str, Any]:
            return {k: v for k, v in vars(f).items() if not (k == "table" and v is None)}

        return {
            "id_features": [plain(f) for f in self.id_features],
            "sequence_groups": [
                {"name": g.name, "max_len": g.max_len, "features": [plain(f) for f in g.features]}
                for g in self.sequence_groups
            ],
            "num_dense": self.num_dense,
            "tasks": list(self.tasks),
            "num_domains": self.num_domains,
        }


def check_names(schema: FeatureSchema, names: Sequence[str], where: str) -> None:
    """Raise naming ``where`` (a config key) if any of ``names`` is not a schema feature."""
    known = set(schema.id_feature_names + schema.sequence_feature_names)
    for n in names:
        if n not in known:
            raise ValueError(schema.unknown_feature_message(n, where))
