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
===================  ==========================  ==============================================

Version 2 added ``request_id``; a version 1 file is a version 2 file without it.

The file's key-value metadata carries ``gem.layout_version`` (``"2"``) and ``gem.schema`` (the
schema as JSON). A data set directory holds ``train/``, ``val/`` and ``test/`` folders of
``*.parquet`` files.

``ParquetBatchReader`` is the simple reference reader (whole files, one process, fail on any
bad value, naming the file, the row, the column and the fix). Training and evaluation use the
streaming loader in gem/data/loader.py (sharded, shuffled, token-balanced, resumable, with a
per-case bad-input policy).
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
from gem.data.schema import FeatureSchema

LAYOUT_VERSION = "2"
READABLE_VERSIONS = ("1", "2")
OPTIONAL_COLUMNS = ("weight", "request_id")


def arrow_schema(schema: FeatureSchema, with_weight: bool = False, with_request_id: bool = False) -> pa.Schema:
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
    metadata = {"gem.layout_version": LAYOUT_VERSION, "gem.schema": json.dumps(schema.to_config())}
    return pa.schema(fields, metadata=metadata)


def write_parquet(table: pa.Table, path: str | Path, schema: FeatureSchema, row_group_size: int = 8192) -> None:
    """Write ``table`` (columns as in the module docstring) atomically to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = arrow_schema(schema, with_weight="weight" in table.column_names,
                          with_request_id="request_id" in table.column_names)
    missing = [n for n in target.names if n not in table.column_names]
    if missing:
        raise ValueError(f"write_parquet: the table lacks columns {missing} of the gem layout v{LAYOUT_VERSION}")
    table = table.select(target.names).cast(target)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    tmp.replace(path)


def list_parquet_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"data directory {str(directory)!r} does not exist; set data.dir to a folder of *.parquet files")
    files = sorted(directory.glob("*.parquet"))
    if not files:
        raise FileNotFoundError(
            f"data directory {str(directory)!r} holds no *.parquet files; point data.dir at a data set, "
            "or delete the folder so that the synthetic generator writes one"
        )
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
        self._columns = [f.name for f in arrow_schema(schema)]

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
                    yield self.to_batch(chunk, str(self.files[i]))
                index += 1
        if pending is not None and pending.num_rows and not self.drop_last and mine(index):
            yield self.to_batch(pending, "last batch")

    def num_rows(self) -> int:
        """Rows in all files, from the Parquet footers (no data read)."""
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)

    def _read(self, path: Path) -> pa.Table:
        try:
            file = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: not a readable Parquet file ({e}); delete or regenerate it") from e
        missing = [c for c in self._columns if c not in file.schema_arrow.names]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; the gem layout v{LAYOUT_VERSION} needs {self._columns} (gem/data/parquet.py)")
        columns = self._columns + [c for c in OPTIONAL_COLUMNS if c in file.schema_arrow.names]
        try:
            table = file.read(columns=columns)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: corrupt or truncated Parquet data ({e}); delete or regenerate it") from e
        self.stats.files.append(str(path))
        self.stats.rows += table.num_rows
        return table

    def to_batch(self, table: pa.Table, where: str) -> Batch:
        """Convert an Arrow table in the gem layout into a validated Batch."""
        s = self.schema
        lengths, values = [], []
        for f in s.id_features:
            ln, vals = _list_column(table, f.name, where)
            _check_ids(vals, f.cardinality, f.name, where)
            lengths.append(ln)
            values.append(vals)
        sparse = _kjt(s.id_feature_names, lengths, values)

        lengths, values, max_seq_len = [], [], {}
        for g in s.sequence_groups:
            group_lengths = None
            for f in g.features:
                ln, vals = _list_column(table, f.name, where)
                _check_ids(vals, f.cardinality, f.name, where)
                if group_lengths is None:
                    group_lengths = ln
                elif not np.array_equal(ln, group_lengths):
                    row = int(np.nonzero(ln != group_lengths)[0][0])
                    raise ValueError(
                        f"{where}, row {row}: column {f.name!r} has {ln[row]} events but {g.features[0].name!r} has "
                        f"{group_lengths[row]}; all features of sequence group {g.name!r} need equal lengths"
                    )
                ln, vals, cut = _keep_most_recent(ln, vals, g.max_len)
                lengths.append(ln)
                values.append(vals)
            self.stats.truncated_histories += cut
            max_seq_len[g.name] = int(lengths[-1].max()) if len(lengths[-1]) else 0
        sequences = _kjt(s.sequence_feature_names, lengths, values)

        dense_lengths, dense = _list_column(table, "dense", where, np.float32)
        if np.any(dense_lengths != s.num_dense):
            row = int(np.nonzero(dense_lengths != s.num_dense)[0][0])
            raise ValueError(f"{where}, row {row}: column 'dense' has {dense_lengths[row]} values, data.schema.num_dense is {s.num_dense}")
        if not np.all(np.isfinite(dense)):
            row = int(np.nonzero(~np.isfinite(dense))[0][0]) // max(s.num_dense, 1)
            raise ValueError(f"{where}, row {row}: column 'dense' holds NaN or inf; clean the data or impute the value")

        labels = np.stack([_column(table, f"label_{t}", where).astype(np.float32) for t in s.tasks], axis=1)
        mask = np.stack([_column(table, f"label_mask_{t}", where).astype(bool) for t in s.tasks], axis=1)
        bad = mask & ~((labels >= 0) & (labels <= 1))
        if bad.any():
            row, task = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"{where}, row {row}: column 'label_{s.tasks[task]}' is {labels[row, task]}, outside [0, 1]; "
                "labels are probabilities or 0/1 (set label_mask to False where unobserved)"
            )
        labels[~mask] = 0.0
        domain = _column(table, "domain", where).astype(np.int64)
        if domain.size and (domain.min() < 0 or domain.max() >= s.num_domains):
            row = int(np.nonzero((domain < 0) | (domain >= s.num_domains))[0][0])
            raise ValueError(f"{where}, row {row}: column 'domain' is {domain[row]}, outside [0, data.schema.num_domains={s.num_domains})")
        weights = None
        if "weight" in table.column_names:
            weights = torch.from_numpy(_column(table, "weight", where).astype(np.float32))
        request_id = None
        if "request_id" in table.column_names:
            request_id = torch.from_numpy(_column(table, "request_id", where).astype(np.int64))
        return Batch(
            sparse=sparse,
            sequences=sequences,
            max_seq_len=max_seq_len,
            dense=torch.from_numpy(dense.reshape(table.num_rows, s.num_dense).copy()),
            labels=torch.from_numpy(labels),
            label_mask=torch.from_numpy(mask),
            domain=torch.from_numpy(domain),
            weights=weights,
            request_id=request_id,
        )


def _column(table: pa.Table, name: str, where: str) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        raise ValueError(f"{where}: column {name!r} has {col.null_count} nulls; every row needs a value")
    return col.to_numpy()


def _list_column(table: pa.Table, name: str, where: str, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Lengths ``[B]`` and flat values ``[T]`` of a list column (nulls read as empty lists)."""
    col = table.column(name).combine_chunks()
    lengths = col.value_lengths().fill_null(0).to_numpy().astype(np.int64)
    values = col.flatten().to_numpy().astype(dtype, copy=False)
    return lengths, values


def _check_ids(values: np.ndarray, cardinality: int, name: str, where: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= cardinality):
        bad = values[(values < 0) | (values >= cardinality)][0]
        raise ValueError(
            f"{where}: column {name!r} holds id {bad}, outside [0, {cardinality}); raise the feature's cardinality "
            f"in data.schema or remap (hash) the ids into range"
        )


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
    """A KJT from per-key lengths and values (key-major), ids as int64, lengths as int32."""
    if not keys:
        return KeyedJaggedTensor.empty()
    return KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values).astype(np.int64, copy=False)),
                             lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)))
