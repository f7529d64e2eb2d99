"""The one Parquet reader: sharded, shuffled, token-balanced, resumable.

How an epoch is cut (every rank computes the same plan from the Parquet footers, no
communication)::

    files -> row groups ("units")                         [f0:rg0][f0:rg1][f1:rg0][f2:rg0] ...
    shuffle units, seeded by (seed, epoch)                [f1:rg0][f0:rg1][f2:rg0][f0:rg0] ...
    = one stream of N rows; rank r takes rows [N*r/R, N*(r+1)/R)       (equal counts, +-1)
    rank's rows -> whole batches; worker w of W takes a contiguous run of them
    worker's rows -> windows of `window_batches * batch_size` rows; in each window:
        read the row groups it spans (only the layout's columns), check every row,
        shuffle the rows (seeded by the window's place in the stream: the shuffle buffer),
        deal them into batches of equal tokens (gem.data.pipeline.balance), one Arrow `take`,
        and slice each batch's list offsets / values into KeyedJaggedTensors.

Since a window is a pure function of (files, seed, epoch, its place), the reader resumes
exactly by counting the batches each worker has handed over: :class:`BatchLoader` records
them in the main process (prefetched, unconsumed batches are not counted, so they are made
again) and a restarted worker rebuilds its current window and skips what was consumed
(:class:`BatchLoader` is in gem/data/pipeline/loader.py).

Copies per batch: Arrow reads the row groups (decode), one gather (`take`) per window for
shuffling / balancing, and one concatenation of the per-key values into the KJT's values.
Offsets and values reach numpy without a copy.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data.errors import DataError
from gem.data.format.checks import (
    CASES,
    Violation,
    cell,
    check_same_schema,
    error_policy,
    file_violations,
    row_violations,
)
from gem.data.format.layout import (
    OPTIONAL_COLUMNS,
    TEACHER_PREFIX,
    TEACHER_REPR,
    arrow_schema,
    present_teachers,
    teacher_columns,
)
from gem.data.pipeline.balance import deal_by_length
from gem.data.pipeline.batch import Batch
from gem.data.pipeline.schema import FeatureSchema

logger = logging.getLogger("gem")


@dataclass
class LoaderOptions:
    """``data.loader`` in config.

    Attributes:
        window_batches: batches per window; the window is the shuffle buffer and the balancing unit.
        balance: deal rows to batches by length so that every batch holds about the same tokens.
        prefetch_factor: batches each DataLoader worker prepares ahead.
        on_error: ``{case: "fail" | "skip"}`` per bad-input case (gem/data/format/checks.py), plus ``default``.
    """

    window_batches: int = 8
    balance: bool = True
    prefetch_factor: int = 4
    on_error: dict[str, str | None] = field(default_factory=lambda: {"default": "fail"} | dict.fromkeys(CASES))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> LoaderOptions:
        cfg = dict(cfg or {})
        unknown = sorted(set(cfg) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"data.loader: unknown keys {unknown}; known: {[f.name for f in fields(cls)]}")
        options = cls(**cfg)
        if options.window_batches < 1 or options.prefetch_factor < 1:
            raise ValueError("data.loader.window_batches and data.loader.prefetch_factor must be >= 1")
        error_policy(options.on_error)  # raises naming the bad key
        return options


@dataclass(frozen=True)
class _Unit:
    file: int
    row_group: int
    first_row: int  # of the row group, in its file
    num_rows: int


class StreamingParquetReader(torch.utils.data.IterableDataset):
    """Yields ``((worker, position), stats, batch_or_None)``; wrap it in :class:`BatchLoader`.

    Args:
        files: Parquet files in the gem layout.
        schema: the feature schema every file must match.
        batch_size: examples per batch (fewer where bad rows were skipped).
        shuffle / seed: seeded shuffle of row groups per epoch and of rows inside each window.
        drop_last: drop each rank's last partial batch (training); keep it for evaluation.
        rank / world_size: this process's share of the rows.
        num_workers: the DataLoader workers that will split this rank's batches (0 = in process).
        options: window, balancing and bad-input policy.
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
        num_workers: int = 0,
        options: LoaderOptions | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        super().__init__()
        self.files = [Path(f) for f in files]
        self.schema = schema
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.options = options or LoaderOptions()
        self.policy = error_policy(self.options.on_error)
        self.epoch = 0
        self.resume = [0] * max(num_workers, 1)  # batches already consumed, per worker
        self.rotation = 0  # DataLoader worker i plays worker (i + rotation) % num_workers
        self.plan_stats: Counter = Counter()
        self._units, optional = self._plan_units()
        target = arrow_schema(
            schema,
            with_weight="weight" in optional,
            with_request_id="request_id" in optional,
            teacher_tasks=present_teachers(optional, schema),
            with_teacher_repr=TEACHER_REPR in optional,
        )  # in every file
        self._target = target.remove_metadata()
        self._cache: tuple[_Unit, pa.Table | None] | None = None

    # -- plan ----------------------------------------------------------------------------
    def _plan_units(self) -> tuple[list[_Unit], set[str]]:
        """Row groups of every usable file; a bad file fails or is skipped (and counted) by policy."""
        units: list[_Unit] = []
        optional = set(OPTIONAL_COLUMNS) | set(teacher_columns(self.schema)) | {TEACHER_REPR}
        footers: list[tuple[pa.Schema, pq.FileMetaData] | Violation] = []
        reference: tuple[Path, FeatureSchema] | None = None  # the first file with gem.schema metadata
        for path in self.files:  # every file's gem.schema first: an odd file is named as such
            try:
                file = pq.ParquetFile(path)
                footers.append((file.schema_arrow, file.metadata))
            except (pa.ArrowException, OSError) as e:
                footers.append(
                    Violation(
                        "unreadable_file", None, None, f"not a readable Parquet file ({e}); delete or regenerate it"
                    )
                )
                continue
            reference = check_same_schema(path, file.schema_arrow, reference, self.schema)
        for i, (path, footer) in enumerate(zip(self.files, footers)):
            if isinstance(footer, Violation):
                file_schema, problems = None, [footer]
            else:
                (file_schema, metadata), problems = footer, file_violations(footer[0], self.schema)
            if problems:
                first = next((p for p in problems if self.policy[p.case] == "fail"), None)
                if first is not None:
                    raise DataError(f"{path}: {first}; set data.loader.on_error.{first.case}=skip to skip such files")
                self.plan_stats["skipped_files"] += 1
                self.plan_stats[f"skipped/{problems[0].case}"] += 1
                logger.warning("skipping %s: %s", path, "; ".join(map(str, problems)))
                continue
            optional &= set(file_schema.names)
            first_row = 0
            for rg in range(metadata.num_row_groups):
                n = metadata.row_group(rg).num_rows
                if n:
                    units.append(_Unit(i, rg, first_row, n))
                first_row += n
        return units, optional

    def num_rows(self) -> int:
        """Rows in all usable files, from the Parquet footers."""
        return sum(u.num_rows for u in self._units)

    def _rank_rows(self, rank: int) -> tuple[int, int]:
        n = self.num_rows()
        return n * rank // self.world_size, n * (rank + 1) // self.world_size

    def num_batches(self, rank: int | None = None) -> int:
        """Batches rank ``rank`` (default: this one) reads per epoch."""
        lo, hi = self._rank_rows(self.rank if rank is None else rank)
        return (hi - lo) // self.batch_size if self.drop_last else -(-(hi - lo) // self.batch_size)

    def _worker_plan(self, worker: int, num_workers: int) -> tuple[int, int, int, int]:
        """(first batch, number of batches, first row, end row) of a worker; rows in the epoch stream."""
        lo, hi = self._rank_rows(self.rank)
        nb = self.num_batches()
        first, last = nb * worker // num_workers, nb * (worker + 1) // num_workers
        end = hi if (worker == num_workers - 1 and not self.drop_last) else min(hi, lo + last * self.batch_size)
        return first, last - first, lo + first * self.batch_size, end

    def _epoch_units(self) -> tuple[list[_Unit], np.ndarray]:
        units = self._units
        if self.shuffle:
            perm = np.random.default_rng((self.seed, self.epoch)).permutation(len(units))
            units = [units[i] for i in perm]
        starts = np.concatenate([[0], np.cumsum([u.num_rows for u in units], dtype=np.int64)])
        return units, starts

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[tuple[int, int], dict[str, int], Batch | None]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        worker = (worker + self.rotation) % num_workers
        if num_workers != max(self.num_workers, 1):
            raise RuntimeError(
                f"the reader was planned for {self.num_workers} workers but runs in {num_workers}; "
                "build it with the DataLoader's num_workers (gem.data.pipeline.loader.build_loader does)"
            )
        units, starts = self._epoch_units()
        _, num_batches, row, end = self._worker_plan(worker, num_workers)
        k = self.options.window_batches
        done = self.resume[worker]
        for window in range(done // k, -(-num_batches // k)):
            first = window * k
            count = min(k, num_batches - first)
            lo = row + first * self.batch_size
            hi = end if first + count == num_batches else lo + count * self.batch_size
            for i, (stats, batch) in enumerate(self._window(units, starts, lo, hi, count)):
                if first + i >= done:
                    yield (worker, first + i), stats, batch

    def _window(
        self, units: list[_Unit], starts: np.ndarray, lo: int, hi: int, num_batches: int
    ) -> list[tuple[dict[str, int], Batch | None]]:
        """The batches of stream rows ``[lo, hi)``, each with its own counts (skipped, truncated)."""
        pieces, where, unreadable = [], [], 0
        u = int(np.searchsorted(starts, lo, side="right")) - 1
        pos = lo
        while pos < hi:
            unit = units[u]
            start = pos - int(starts[u])
            take = min(unit.num_rows - start, hi - pos)
            table = self._read_unit(unit)
            if table is None:
                unreadable += take
            else:
                pieces.append(table.slice(start, take))
                where.append((unit.file, unit.first_row + start, take))
            pos += take
            u += 1
        table = pa.concat_tables(pieces) if pieces else self._target.empty_table()
        n = table.num_rows
        bad = np.zeros(n, dtype=bool)
        case_of = np.full(n, "", dtype=object)
        for case, column, rows, message in row_violations(table, self.schema):
            if self.policy[case] == "fail":
                path, file_row = self._locate(where, int(rows[0]))
                raise DataError(
                    f"{path}, row {file_row}: column {column!r}: {message}; the row holds "
                    f"{cell(table, column, int(rows[0]))}; set data.loader.on_error.{case}=skip to skip "
                    "and count such rows"
                )
            fresh = rows[~bad[rows]]
            case_of[fresh] = case
            bad[fresh] = True

        lengths = np.zeros(n, dtype=np.int64)
        for g in self.schema.sequence_groups:
            offsets = table.column(g.features[0].name).combine_chunks().offsets.to_numpy()
            lengths += np.minimum(np.diff(offsets), g.max_len)
        order = np.random.default_rng((self.seed, self.epoch, lo)).permutation(n) if self.shuffle else np.arange(n)
        if self.options.balance:
            rank_in_order = np.empty(n, dtype=np.int64)
            rank_in_order[order] = np.arange(n)
            groups = [b[np.argsort(rank_in_order[b])] for b in deal_by_length(lengths, num_batches, order)]
        else:
            groups = [order[i * self.batch_size : (i + 1) * self.batch_size] for i in range(num_batches)]

        kept = [g[~bad[g]] for g in groups]
        gathered = table.take(np.concatenate(kept)) if n else table
        out, offset = [], 0
        for i, (g, keep) in enumerate(zip(groups, kept)):
            stats = Counter({"rows": len(keep), "batches": 1})
            for case in case_of[g][bad[g]]:
                stats["skipped_rows"] += 1
                stats[f"skipped/{case}"] += 1
            if i == 0 and unreadable:
                stats["skipped_rows"] += unreadable
                stats["skipped/unreadable_file"] += unreadable
            batch = None
            if len(keep):
                batch, truncated = table_to_batch(gathered.slice(offset, len(keep)), self.schema)
                stats["truncated_histories"] += truncated
                stats["tokens"] += int(lengths[keep].sum())
            offset += len(keep)
            out.append((dict(stats), batch))
        return out

    def _read_unit(self, unit: _Unit) -> pa.Table | None:
        if self._cache is not None and self._cache[0] == unit:
            return self._cache[1]
        path = self.files[unit.file]
        try:
            file = pq.ParquetFile(path)
            table = file.read_row_group(unit.row_group, columns=self._target.names)
            table = table.replace_schema_metadata(None).cast(self._target)
        except (pa.ArrowException, OSError) as e:
            if self.policy["unreadable_file"] == "fail":
                raise DataError(
                    f"{path}: row group {unit.row_group} is corrupt or truncated ({e}); delete or "
                    "regenerate the file, or set data.loader.on_error.unreadable_file=skip"
                ) from e
            logger.warning("skipping row group %d of %s: %s", unit.row_group, path, e)
            table = None
        self._cache = (unit, table)
        return table

    def _locate(self, where: list[tuple[int, int, int]], row: int) -> tuple[Path, int]:
        for file, first_row, count in where:
            if row < count:
                return self.files[file], first_row + row
            row -= count
        raise IndexError(row)


def _list_parts(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Lengths ``[B]`` and values ``[T]`` of a list column; views of the Arrow buffers, no copy."""
    arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy()
    return np.diff(offsets), values


def table_to_batch(table: pa.Table, schema: FeatureSchema) -> tuple[Batch, int]:
    """A checked Arrow table in the gem layout -> (Batch, number of histories truncated to max_len).

    The reader's conversion (also the teacher export's); ``table`` has passed gem/data/format/checks.py
    (no nulls, ids in range, equal lengths within a sequence group, ``num_dense`` values per row).
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
        optional["teacher"] = torch.from_numpy(
            np.stack(
                [
                    table.column(f"{TEACHER_PREFIX}{t}").to_numpy().astype(np.float32)
                    if f"{TEACHER_PREFIX}{t}" in table.column_names
                    else np.full(num_rows, np.nan, np.float32)
                    for t in tasks
                ],
                axis=1,
            )
        )
    if TEACHER_REPR in table.column_names:
        _, rep = _list_parts(table.column(TEACHER_REPR))  # checked: one width in every row
        optional["teacher_repr"] = torch.from_numpy(rep.astype(np.float32).reshape(num_rows, -1))
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
    keep = np.repeat(starts - np.concatenate([[0], np.cumsum(new_lengths)[:-1]]), new_lengths) + np.arange(
        new_lengths.sum()
    )
    return new_lengths, values[keep], cut


def _kjt(keys: list[str], lengths: list[np.ndarray], values: list[np.ndarray]) -> KeyedJaggedTensor:
    """A KJT from per-key lengths and values (key-major), ids as int64, lengths as int32. The ids
    per key are counted here, on the host: a KJT on the GPU without them counts them with a
    device-to-host copy (a sync) at its first ``to_dict()``, every step."""
    if not keys:
        return KeyedJaggedTensor.empty()
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.concatenate(values).astype(np.int64, copy=False)),
        lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
        length_per_key=[int(n.sum()) for n in lengths],
    )
