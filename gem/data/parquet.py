"""The gem Parquet layout (version 2; version 1 files stay readable) and a simple, validating reader that yields Batches.

One row per example. Columns, for a schema with id features ``F``, sequence features ``S``,
tasks ``K``:

===================  ==========================  ==============================================
column               Arrow type                  meaning
===================  ==========================  ==============================================
``<f>`` for f in F   ``list<int64>``             ids of a pooled feature (multi-hot allowed)
``<s>`` for s in S   ``list<int64>``             per-event ids, oldest first; the features of
                                                 one sequence group have equal lengths per row
``dense``            ``list<float32>``           ``num_dense`` values per row
``label_<k>``        ``float32``                 label in [0, 1]
``label_mask_<k>``   ``bool``                    False where task k is unobserved
``domain``           ``int64``                   surface / domain index in [0, num_domains)
``weight``           ``float32`` (optional)      example weight
``request_id``       ``int64`` (optional, v2)    candidate group: the rows scored together for
                                                 one request (ranking evaluation)
``teacher_<k>``      ``float32`` (optional)      a teacher model's logit for task k
                                                 (knowledge transfer, docs/transfer.md)
===================  ==========================  ==============================================

Version 2 added ``request_id``; a version 1 file is a version 2 file without it.

The file's key-value metadata carries ``gem.layout_version`` (``"2"``) and ``gem.schema`` (the
schema as JSON). A data set directory holds ``train/``, ``val/`` and ``test/`` folders of
``*.parquet`` files.

``ParquetBatchReader`` is the simple reference reader (whole files, one process, fail on any
bad value, naming the file, the row, the column and the fix). Training and evaluation use the
streaming loader in gem/data/loader.py (sharded, shuffled, token-balanced, resumable, with a
per-case bad-input policy). Both check files and rows with gem/data/checks.py and turn Arrow
tables into Batches with ``table_to_batch`` (here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data.batch import Batch
from gem.data.errors import DataError, MissingDataError
from gem.data.schema import FeatureSchema

LAYOUT_VERSION = "2"
READABLE_VERSIONS = ("1", "2")
OPTIONAL_COLUMNS = ("weight", "request_id")
TEACHER_PREFIX = "teacher_"  # optional ``teacher_<task>`` float32 columns: a teacher's logits


def teacher_columns(schema: FeatureSchema) -> list[str]:
    """The optional teacher-logit column of every task of ``schema``."""
    return [f"{TEACHER_PREFIX}{t}" for t in schema.tasks]


def is_optional_column(name: str) -> bool:
    return name in OPTIONAL_COLUMNS or name.startswith(TEACHER_PREFIX)


def arrow_schema(schema: FeatureSchema, with_weight: bool = False, with_request_id: bool = False,
                 teacher_tasks: tuple[str, ...] | list[str] = ()) -> pa.Schema:
    ids = pa.list_(pa.int64())
    fields = [pa.field(n, ids) for n in schema.id_feature_names + schema.sequence_feature_names]
    fields.append(pa.field("dense", pa.list_(pa.float32())))
    for task in schema.tasks:
        fields += [pa.field(f"label_{task}", pa.float32()), pa.field(f"label_mask_{task}", pa.bool_())]
    fields.append(pa.field("domain", pa.int64()))
    if with_weight:
        fields.append(pa.field("weight", pa.float32()))
    if with_request_id:
        fields.append(pa.field("request_id", pa.int64()))
    fields += [pa.field(f"{TEACHER_PREFIX}{t}", pa.float32()) for t in schema.tasks if t in teacher_tasks]
    metadata = {"gem.layout_version": LAYOUT_VERSION, "gem.schema": json.dumps(schema.to_config())}
    return pa.schema(fields, metadata=metadata)


def write_parquet(table: pa.Table, path: str | Path, schema: FeatureSchema, row_group_size: int = 8192) -> None:
    """Write ``table`` (columns as in the module docstring) atomically to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = arrow_schema(schema, with_weight="weight" in table.column_names,
                          with_request_id="request_id" in table.column_names, teacher_tasks=present_teachers(table.column_names, schema))
    missing = [n for n in target.names if n not in table.column_names]
    if missing:
        raise ValueError(f"write_parquet: the table lacks columns {missing} of the gem layout v{LAYOUT_VERSION}")
    table = table.select(target.names).cast(target)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    tmp.replace(path)


def present_teachers(names, schema: FeatureSchema) -> tuple[str, ...]:
    """The tasks of ``schema`` whose ``teacher_<task>`` column is among ``names``."""
    return tuple(t for t in schema.tasks if f"{TEACHER_PREFIX}{t}" in names)


def list_parquet_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise MissingDataError(f"data directory {str(directory)!r} does not exist; give a folder of *.parquet files "
                               "(a data set's train/, val/ or test/ folder)")
    files = sorted(directory.glob("*.parquet"))
    if not files:
        raise MissingDataError(f"data directory {str(directory)!r} holds no *.parquet files; give a folder of "
                               "*.parquet files in the gem layout (a data set's train/, val/ or test/ folder)")
    return files


@dataclass
class ReaderStats:
    rows: int = 0
    truncated_histories: int = 0
    files: list[str] = field(default_factory=list)


class ParquetBatchReader(torch.utils.data.IterableDataset):
    """Iterate Batches over Parquet files in the gem layout (use with ``DataLoader(batch_size=None)``).

    Args:
        files: Parquet files, read in order (shuffled by file and row when ``shuffle``).
        schema: the feature schema every file must match.
        batch_size: examples per batch; the last, smaller batch is kept unless ``drop_last``.
        shuffle / seed: seeded permutation of files and of rows within each file, per epoch.
        rank / world_size: this process takes every ``world_size``-th batch starting at ``rank``;
            DataLoader workers take turns over a rank's batches, so no batch is read twice and a
            rank's k-th batch is global batch ``k * world_size + rank`` for any number of workers.
            ``set_epoch(epoch, start_batch)`` starts an epoch part-way (resume).
    """

    def __init__(
        self,
        files: list[Path],
        schema: FeatureSchema,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        super().__init__()
        self.files = list(files)
        self.schema = schema
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start_batch = 0
        self.stats = ReaderStats()
        _check_same_schema(self.files, schema)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Read epoch ``epoch`` (its seeded shuffle) from its global batch ``start_batch`` on:
        batches ``[0, start_batch)`` of every rank are skipped without being decoded (resume)."""
        self.epoch = epoch
        self.start_batch = start_batch

    def __iter__(self) -> Iterator[Batch]:
        worker = torch.utils.data.get_worker_info()
        num_workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        # Batch i goes to rank i % world_size, and within a rank round-robin to its workers (counted
        # from start_batch), as the DataLoader collects them: a rank's k-th batch is global batch
        # start_batch + k * world_size + rank.
        first = self.start_batch // self.world_size
        mine = lambda i: (i % self.world_size == self.rank  # noqa: E731
                          and (i // self.world_size - first) % num_workers == worker_id)
        rng = np.random.default_rng((self.seed, self.epoch))
        order = rng.permutation(len(self.files)) if self.shuffle else range(len(self.files))
        index = 0
        pending: pa.Table | None = None
        for i in order:
            table = self._read(self.files[i])
            if self.shuffle:
                table = table.take(rng.permutation(table.num_rows))
            pending = table if pending is None else pa.concat_tables([pending, table])
            while pending.num_rows >= self.batch_size:
                chunk, pending = pending.slice(0, self.batch_size), pending.slice(self.batch_size)
                if mine(index) and index >= self.start_batch:
                    yield self._convert(chunk)
                index += 1
        if pending is not None and pending.num_rows and not self.drop_last and mine(index):
            yield self._convert(pending)

    def num_rows(self) -> int:
        """Rows in all files, from the Parquet footers (no data read)."""
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)

    def _read(self, path: Path) -> pa.Table:
        """The layout's columns of ``path``, cast to the layout's types, every row checked."""
        from gem.data.checks import file_violations  # checks imports the layout from this module

        try:
            file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e}); delete or regenerate it") from e
        problems = file_violations(file.schema_arrow, self.schema)
        if problems:
            raise DataError(f"{path}: " + "; ".join(map(str, problems)))
        names = file.schema_arrow.names
        target = arrow_schema(self.schema, with_weight="weight" in names, with_request_id="request_id" in names,
                              teacher_tasks=present_teachers(names, self.schema))
        target = target.remove_metadata()
        try:
            table = file.read(columns=target.names)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: corrupt or truncated Parquet data ({e}); delete or regenerate it") from e
        table = table.select(target.names).replace_schema_metadata(None).cast(target)
        _check_rows(table, self.schema, str(path))
        self.stats.files.append(str(path))
        self.stats.rows += table.num_rows
        return table

    def to_batch(self, table: pa.Table, where: str) -> Batch:
        """Convert an Arrow table in the gem layout into a validated Batch (``where`` names it in errors)."""
        _check_rows(table, self.schema, where)
        return self._convert(table)

    def _convert(self, table: pa.Table) -> Batch:
        batch, truncated = table_to_batch(table, self.schema)
        self.stats.truncated_histories += truncated
        return batch


def _check_same_schema(files: list[Path], schema: FeatureSchema) -> None:
    """Every file's gem.schema metadata agrees (footers only; unreadable files fail when read)."""
    from gem.data.checks import check_same_schema  # checks imports the layout from this module

    reference = None
    for path in files:
        try:
            file_schema = pq.read_schema(path)
        except (pa.ArrowException, OSError):
            continue
        reference = check_same_schema(path, file_schema, reference, schema)


def _check_rows(table: pa.Table, schema: FeatureSchema, where: str) -> None:
    """Raise on the first bad row of ``table`` (gem/data/checks.py), naming ``where``, the row, the column and the fix."""
    from gem.data.checks import Violation, row_violations  # checks imports the layout from this module

    for case, column, rows, message in row_violations(table, schema):
        row = int(rows[0])
        raise DataError(f"{where}: {Violation(case, column, row, message)}; "
                        f"the row holds {_cell(table, column, row)}")


def _cell(table: pa.Table, column: str, row: int, limit: int = 8) -> str:
    """The value in ``column`` at ``row``, for an error message; a long list is shortened."""
    value = table.column(column)[row].as_py()
    if isinstance(value, list) and len(value) > limit:
        return f"[{', '.join(map(str, value[:limit]))}, ...] ({len(value)} values)"
    return str(value)


def _list_parts(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Lengths ``[B]`` and values ``[T]`` of a list column; views of the Arrow buffers, no copy."""
    arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy()
    return np.diff(offsets), values


def table_to_batch(table: pa.Table, schema: FeatureSchema) -> tuple[Batch, int]:
    """A checked Arrow table in the gem layout -> (Batch, number of histories truncated to max_len).

    The one conversion of both readers; ``table`` has passed gem/data/checks.py (no nulls, ids in
    range, equal lengths within a sequence group, ``num_dense`` values per row).
    """
    num_rows = table.num_rows
    lengths, values = [], []
    for f in schema.id_features:
        ln, vals = _list_parts(table.column(f.name))
        lengths.append(ln)
        values.append(vals)
    sparse = _kjt(schema.id_feature_names, lengths, values)

    lengths, values, max_seq_len, truncated = [], [], {}, 0
    for g in schema.sequence_groups:
        for f in g.features:
            ln, vals = _list_parts(table.column(f.name))
            ln, vals, cut = _keep_most_recent(ln, vals, g.max_len)
            lengths.append(ln)
            values.append(vals)
        truncated += cut
        max_seq_len[g.name] = int(lengths[-1].max()) if num_rows else 0
    sequences = _kjt(schema.sequence_feature_names, lengths, values)

    _, dense = _list_parts(table.column("dense"))
    tasks = schema.tasks
    labels = np.stack([table.column(f"label_{t}").to_numpy() for t in tasks], axis=1).astype(np.float32)
    mask = np.stack([table.column(f"label_mask_{t}").to_numpy(zero_copy_only=False) for t in tasks], axis=1)
    labels[~mask] = 0.0
    optional = {}
    if "weight" in table.column_names:
        optional["weights"] = torch.from_numpy(table.column("weight").to_numpy().astype(np.float32))
    if "request_id" in table.column_names:
        optional["request_id"] = torch.from_numpy(table.column("request_id").to_numpy().astype(np.int64))
    if any(f"{TEACHER_PREFIX}{t}" in table.column_names for t in tasks):  # absent tasks: NaN
        optional["teacher"] = torch.from_numpy(np.stack(
            [table.column(f"{TEACHER_PREFIX}{t}").to_numpy().astype(np.float32) if f"{TEACHER_PREFIX}{t}" in
             table.column_names else np.full(num_rows, np.nan, np.float32) for t in tasks], axis=1))
    batch = Batch(
        sparse=sparse,
        sequences=sequences,
        max_seq_len=max_seq_len,
        dense=torch.from_numpy(dense.astype(np.float32).reshape(num_rows, schema.num_dense)),
        labels=torch.from_numpy(labels),
        label_mask=torch.from_numpy(mask),
        domain=torch.from_numpy(table.column("domain").to_numpy().astype(np.int64)),
        **optional,
    )
    return batch, truncated


def _keep_most_recent(lengths: np.ndarray, values: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Truncate each history to its ``max_len`` most recent (last) events; returns the count of cut rows."""
    cut = int((lengths > max_len).sum())
    if not cut:
        return lengths, values, 0
    new_lengths = np.minimum(lengths, max_len)
    ends = np.cumsum(lengths)
    starts = ends - new_lengths
    keep = np.repeat(starts - np.concatenate([[0], np.cumsum(new_lengths)[:-1]]), new_lengths) + np.arange(new_lengths.sum())
    return new_lengths, values[keep], cut


def _kjt(keys: list[str], lengths: list[np.ndarray], values: list[np.ndarray]) -> KeyedJaggedTensor:
    """A KJT from per-key lengths and values (key-major), ids as int64, lengths as int32. The ids
    per key are counted here, on the host: a KJT on the GPU without them counts them with a
    device-to-host copy (a sync) at its first ``to_dict()``, every step."""
    if not keys:
        return KeyedJaggedTensor.empty()
    return KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values).astype(np.int64, copy=False)),
                             lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
                             length_per_key=[int(n.sum()) for n in lengths])
