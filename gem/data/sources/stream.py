"""A stream of time-ordered partitions: ``data.dir/day=YYYY-MM-DD/*.parquet`` (``data.kind=stream``).

Training makes one pass over the partitions in date order, each example once; partition ``e`` is
the loader's "epoch" ``e``, so a checkpoint's position (epoch, examples consumed in it) is a
partition and a place in it, and a restart continues there. New partitions may appear between
runs: the same command resumes and trains on them. A partition dated before the one the
checkpoint stands in (or a missing one) stops the run with an error naming both: the stream only
moves forward. A day missing between the first and the last partition is trained without, with one
warning naming it. The partition rules (names, dates, order) live in gem/data/format/dataset.py,
where the validator reads them too. There are no ``val/`` or ``test/`` splits: the trainer scores each partition before
training on it (progressive evaluation, docs/streaming.md).

Raw ids: ``data.stream.raw_features`` lists the features whose ids in the files are raw, in
``[0, data.stream.raw_space)``, larger than their tables (``data.schema``'s cardinality); the reader
accepts them and ``sparse.ids`` maps them to rows (gem/sparse/ids.py).

With ``data.dir`` unset a synthetic stream is generated into ``data.cache_dir``
(:func:`write_synthetic_stream`): day ``d`` is the synthetic world (gem/data/sources/synthetic.py)
at ``drift = min(1, d * drift_per_day)``, and with ``id_lifetime_days > 0`` every user and item
takes a new raw id every that many days (each at its own phase), so new ids keep appearing and old
ones stop.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gem.data.errors import DataError, MissingDataError
from gem.data.format.dataset import (
    gaps_message,
    list_partitions,
    make_once,
    resume_problem,
    schema_from_files,
    split_files,
)
from gem.data.pipeline.loader import BatchLoader, build_loader
from gem.data.pipeline.schema import FeatureSchema
from gem.data.sources.base import DataSource

_INT64_MAX = 2**63 - 1
_RENEWED = ("user_id", "ad_id", "hist_item")  # the synthetic stream's features whose ids are renewed
logger = logging.getLogger("gem")


@dataclass(frozen=True)
class StreamOptions:
    """``data.stream`` (see the module docstring)."""

    raw_features: list[str] = field(default_factory=list)  # features whose ids in the files are raw
    raw_space: int = 2**63  # their ids lie in [0, raw_space)
    # The synthetic stream (data.dir unset):
    days: int = 7
    examples_per_day: int = 20000
    start: str = "2026-11-23"  # the first day's date
    id_lifetime_days: float = 0.0  # > 0: users and items take a new raw id every this many days
    drift_per_day: float = 0.0  # day d's world has drift min(1, d * drift_per_day)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> StreamOptions:
        try:
            options = cls(**dict(cfg))
        except TypeError as e:
            raise ValueError(f"data.stream: {e}; known keys: {list(cls.__dataclass_fields__)}") from None
        if not 1 <= options.raw_space <= 2**63:
            raise ValueError(f"data.stream.raw_space={options.raw_space} must be in [1, 2**63]")
        if options.id_lifetime_days < 0 or options.drift_per_day < 0 or options.days < 1:
            raise ValueError("data.stream: days must be >= 1, id_lifetime_days and drift_per_day >= 0")
        return options


def read_schema(schema: FeatureSchema, options: StreamOptions) -> FeatureSchema:
    """``schema`` with the raw features' cardinality raised to their raw space: what the files hold."""
    known = schema.id_feature_names + schema.sequence_feature_names
    unknown = [f for f in options.raw_features if f not in known]
    if unknown:
        raise ValueError(f"data.stream.raw_features: {unknown} are not features of data.schema ({known})")
    space = min(options.raw_space, _INT64_MAX)  # int64 ids; 2**63 - 1 itself is the empty-row sentinel of mch

    def raw(f):
        return dataclasses.replace(f, cardinality=space) if f.name in options.raw_features else f

    groups = [dataclasses.replace(g, features=[raw(f) for f in g.features]) for g in schema.sequence_groups]
    return dataclasses.replace(schema, id_features=[raw(f) for f in schema.id_features], sequence_groups=groups)


@dataclass(frozen=True)
class StreamSource(DataSource):
    """A :class:`DataSource` of partitions: ``files(<partition>)``, ``loader(<partition>)`` for one of
    them (progressive evaluation), ``loader("train")`` for the one pass over all (:class:`StreamLoader`)."""

    partitions: tuple[str, ...] = ()
    file_schema: FeatureSchema | None = None  # what the reader checks the files against (raw ids)

    def files(self, split: str) -> list[Path]:
        if split == "train":  # the schema's and the checks' sample: the first partition
            split = self.partitions[0]
        if split not in self.partitions:
            raise MissingDataError(
                f"data.kind=stream has no split {split!r}: its partitions are {list(self.partitions)}; "
                "each partition is scored before it is trained on (no val/ or test/)"
            )
        return split_files(self.dir, split)

    def loader(self, split: str, batch_size: int, **kwargs: Any):
        if split == "train":
            return StreamLoader(self, batch_size, kwargs)
        return build_loader(self.files(split), self.file_schema or self.schema, batch_size, **kwargs)


class StreamLoader:
    """The training loader of a stream: partition ``e`` is epoch ``e``, read once, in order.

    It has the BatchLoader surface the trainer and the Checkpointer use (``set_epoch``,
    ``consumed``, ``steps_per_epoch``, ``stats``, ``state_dict`` ...). Its state names the partition,
    so a resume that finds another partition at that place raises (:meth:`check_resume`)."""

    def __init__(self, source: StreamSource, batch_size: int, kwargs: dict[str, Any]) -> None:
        self.source, self.batch_size = source, batch_size
        self.kwargs = {**kwargs, "drop_last": False}  # each example once: a partition's last batch may be short
        self.epoch, self.inner = -1, None
        self.resume_error: str | None = None
        self.set_epoch(0)

    @property
    def num_partitions(self) -> int:
        return len(self.source.partitions)

    @property
    def partition(self) -> str:
        return self.source.partitions[self.epoch]

    def set_epoch(self, epoch: int) -> None:
        if epoch >= self.num_partitions:  # only from a checkpoint: partitions were removed since
            self.resume_error = resume_problem(self.source.dir, list(self.source.partitions), None, epoch)
            return
        if epoch != self.epoch:
            self.epoch = epoch
            self.inner: BatchLoader = self.source.loader(self.partition, self.batch_size, **self.kwargs)
            self.inner.set_epoch(epoch)

    def total_steps(self) -> int:
        """Steps of the whole pass: every partition's batches."""
        return sum(
            self.source.loader(p, self.batch_size, **self.kwargs).steps_per_epoch for p in self.source.partitions
        )

    @property
    def steps_per_epoch(self) -> int:
        return self.inner.steps_per_epoch

    @property
    def consumed(self) -> list[int]:
        return self.inner.consumed

    @property
    def stats(self):
        return self.inner.stats

    @property
    def reader(self):
        return self.inner.reader

    def num_rows(self) -> int:
        return self.inner.num_rows()

    def __iter__(self) -> Iterator:
        return iter(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "partitions_before": self.epoch, "loader": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("partition")
        if self.resume_error is None:
            self.resume_error = resume_problem(self.source.dir, list(self.source.partitions), saved, self.epoch)
        if self.resume_error is not None:
            raise ValueError(self.resume_error)
        self.inner.load_state_dict(state["loader"])

    def check_resume(self) -> None:
        """Raise the DataError of a resume whose partition moved (the Checkpointer only warns for a loader state)."""
        if self.resume_error is not None:
            raise DataError(self.resume_error)


def open_source(data_cfg: Any, is_writer: bool = True) -> StreamSource:
    """``data.dir``'s partitions, or the synthetic stream generated into ``data.cache_dir``."""
    options = StreamOptions.from_config(data_cfg.stream)
    directory = Path(data_cfg.dir) if data_cfg.dir else prepare_synthetic_stream(data_cfg, options, is_writer)
    partitions = tuple(list_partitions(directory))
    gaps = gaps_message(directory, list(partitions))
    if gaps and is_writer:  # once per run, from rank 0
        logger.warning(gaps)
    schema = (
        FeatureSchema.from_config(data_cfg.schema)
        if data_cfg.schema
        else schema_from_files(split_files(directory, partitions[0]))
    )
    return StreamSource(data_cfg.kind, schema, directory, partitions, read_schema(schema, options))


# ------------------------------------------------------------------------------ synthetic stream


def prepare_synthetic_stream(data_cfg: Any, options: StreamOptions, is_writer: bool) -> Path:
    """The synthetic stream's folder in ``data.cache_dir`` (generated on first use, by rank 0)."""
    schema = FeatureSchema.from_config(data_cfg.schema)
    key = json.dumps(
        {
            "schema": schema.to_config(),
            "seed": data_cfg.seed,
            "synthetic": dict(data_cfg.synthetic),
            "stream": dataclasses.asdict(options),
        },
        sort_keys=True,
    )
    directory = Path(data_cfg.cache_dir) / f"{data_cfg.name}-stream-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    knobs = dict(data_cfg.synthetic)
    make = functools.partial(write_synthetic_stream, directory, schema, options, data_cfg.seed, knobs)
    return make_once(directory, make, is_writer, 600, "generate")


def write_synthetic_stream(
    directory: Path, schema: FeatureSchema, options: StreamOptions, seed: int, knobs: Mapping[str, Any]
) -> None:
    """``options.days`` partitions of ``options.examples_per_day`` rows each, written atomically."""
    from gem.data.format.layout import write_parquet
    from gem.data.sources.synthetic import SyntheticConfig, generate

    if options.id_lifetime_days and not set(_RENEWED) <= set(options.raw_features):
        raise ValueError(
            f"data.stream.id_lifetime_days={options.id_lifetime_days} renews the ids of {list(_RENEWED)}, "
            f"which are then raw: set data.stream.raw_features={list(_RENEWED)} (and map them with sparse.ids)"
        )
    files_schema = read_schema(schema, options)
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    start = datetime.date.fromisoformat(options.start)
    for day in range(options.days):
        cfg = SyntheticConfig(**{**knobs, "drift": min(1.0, knobs.get("drift", 0.0) + day * options.drift_per_day)})
        table = generate(schema, options.examples_per_day, seed=seed * 1000 + 100 + day, cfg=cfg, world_seed=seed)
        if options.id_lifetime_days:
            table = _renew_ids(table, day, options, seed)
        name = f"day={start + datetime.timedelta(days=day)}"
        write_parquet(table, tmp / name / "part-00000.parquet", files_schema)
    tmp.rename(directory)


def _renew_ids(table: pa.Table, day: int, options: StreamOptions, seed: int) -> pa.Table:
    """Users and items as raw ids of their current generation: entity ``i`` of kind ``k`` is
    ``mix(k, i, floor(day / lifetime + phase_i)) % raw_space`` on ``day`` (phases uniform in [0, 1))."""
    space = min(options.raw_space, _INT64_MAX)
    for name in _RENEWED:
        kind = "user" if name == "user_id" else "item"  # ad_id and hist_item: one item catalogue
        column = table.column(name).combine_chunks()
        ids = column.values.to_numpy().astype(np.uint64)
        phase = np.random.default_rng([seed, 7, len(kind)]).random(int(ids.max(initial=0)) + 1 if ids.size else 1)
        generation = np.floor(day / options.id_lifetime_days + phase[ids]).astype(np.uint64)
        raw = _mix(ids, generation, len(kind)) % np.uint64(space)
        table = table.set_column(
            table.schema.get_field_index(name),
            name,
            pa.ListArray.from_arrays(column.offsets, pa.array(raw.astype(np.int64))),
        )
    return table


def _mix(ids: np.ndarray, generation: np.ndarray, salt: int) -> np.ndarray:
    """SplitMix64's finalizer of (id, generation, salt): distinct raw ids for distinct pairs, spread out."""
    with np.errstate(over="ignore"):
        z = ids * np.uint64(0x9E3779B97F4A7C15) + generation * np.uint64(0xD1B54A32D192ED03) + np.uint64(salt)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
