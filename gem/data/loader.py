"""The streaming Parquet reader: sharded, shuffled, token-balanced, resumable.

How an epoch is cut (every rank computes the same plan from the Parquet footers, no
communication)::

    files -> row groups ("units")                         [f0:rg0][f0:rg1][f1:rg0][f2:rg0] ...
    shuffle units, seeded by (seed, epoch)                [f1:rg0][f0:rg1][f2:rg0][f0:rg0] ...
    = one stream of N rows; rank r takes rows [N*r/R, N*(r+1)/R)       (equal counts, +-1)
    rank's rows -> whole batches; worker w of W takes a contiguous run of them
    worker's rows -> windows of `window_batches * batch_size` rows; in each window:
        read the row groups it spans (only the layout's columns), check every row,
        shuffle the rows (seeded by the window's place in the stream: the shuffle buffer),
        deal them into batches of equal tokens (gem.data.balance), one Arrow `take`,
        and slice each batch's list offsets / values into KeyedJaggedTensors.

Since a window is a pure function of (files, seed, epoch, its place), the reader resumes
exactly by counting the batches each worker has handed over: :class:`BatchLoader` records
them in the main process (prefetched, unconsumed batches are not counted, so they are made
again) and a restarted worker rebuilds its current window and skips what was consumed.

Copies per batch: Arrow reads the row groups (decode), one gather (`take`) per window for
shuffling / balancing, and one concatenation of the per-key values into the KJT's values.
Offsets and values reach numpy without a copy.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gem.data.balance import deal_by_length
from gem.data.batch import Batch
from gem.data.checks import Violation, check_same_schema, error_policy, file_violations, row_violations
from gem.data.errors import DataError
from gem.data.parquet import OPTIONAL_COLUMNS, arrow_schema, present_teachers, table_to_batch, teacher_columns
from gem.data.schema import FeatureSchema

logger = logging.getLogger("gem")

STATE_VERSION = 1


@dataclass
class LoaderOptions:
    """``data.loader`` in config.

    Attributes:
        window_batches: batches per window; the window is the shuffle buffer and the balancing unit.
        balance: deal rows to batches by length so that every batch holds about the same tokens.
        prefetch_factor: batches each DataLoader worker prepares ahead.
        on_error: ``{case: "fail" | "skip"}`` per bad-input case (gem/data/checks.py), plus ``default``.
    """

    window_batches: int = 8
    balance: bool = True
    prefetch_factor: int = 4
    on_error: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> "LoaderOptions":
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

    def __init__(self, files: list[Path], schema: FeatureSchema, batch_size: int, *, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 options: LoaderOptions | None = None) -> None:
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
        target = arrow_schema(schema, with_weight="weight" in optional, with_request_id="request_id" in optional,
                              teacher_tasks=present_teachers(optional, schema))  # in every file
        self._target = target.remove_metadata()
        self._cache: tuple[_Unit, pa.Table | None] | None = None

    # -- plan ----------------------------------------------------------------------------
    def _plan_units(self) -> tuple[list[_Unit], set[str]]:
        """Row groups of every usable file; a bad file fails or is skipped (and counted) by policy."""
        units: list[_Unit] = []
        optional = set(OPTIONAL_COLUMNS) | set(teacher_columns(self.schema))
        footers: list[tuple[pa.Schema, pq.FileMetaData] | Violation] = []
        reference: tuple[Path, FeatureSchema] | None = None  # the first file with gem.schema metadata
        for path in self.files:  # every file's gem.schema first: an odd file is named as such
            try:
                file = pq.ParquetFile(path)
                footers.append((file.schema_arrow, file.metadata))
            except (pa.ArrowException, OSError) as e:
                footers.append(Violation("unreadable_file", None, None,
                                         f"not a readable Parquet file ({e}); delete or regenerate it"))
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
            raise RuntimeError(f"the reader was planned for {self.num_workers} workers but runs in {num_workers}; "
                               "build it with the DataLoader's num_workers (gem.data.loader.build_loader does)")
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

    def _window(self, units: list[_Unit], starts: np.ndarray, lo: int, hi: int,
                num_batches: int) -> list[tuple[dict[str, int], Batch | None]]:
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
                raise DataError(f"{path}, row {file_row}: column {column!r}: {message}; set "
                                f"data.loader.on_error.{case}=skip to skip and count such rows")
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
            groups = [order[i * self.batch_size:(i + 1) * self.batch_size] for i in range(num_batches)]

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
                raise DataError(f"{path}: row group {unit.row_group} is corrupt or truncated ({e}); delete or "
                                "regenerate the file, or set data.loader.on_error.unreadable_file=skip") from e
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


class BatchLoader:
    """A DataLoader over a :class:`StreamingParquetReader` that knows where it stands.

    Iterate it for one epoch of Batches (``set_epoch`` first); ``state_dict()`` is a plain
    dict of ints / strings / lists that ``load_state_dict`` restores to continue with the
    next unconsumed batch. ``stats`` counts rows, batches, tokens, skipped rows (per case)
    and truncated histories over the batches handed out.
    """

    def __init__(self, reader: StreamingParquetReader, pin_memory: bool = False) -> None:
        self.reader = reader
        self.pin_memory = pin_memory
        self.epoch = 0
        self.consumed = [0] * max(reader.num_workers, 1)
        self.stats: Counter = Counter(reader.plan_stats)
        self._warned_truncation = False

    def __len__(self) -> int:
        return self.reader.num_batches()

    @property
    def steps_per_epoch(self) -> int:
        """Batches every rank has: the steps a synchronous epoch can take."""
        return min(self.reader.num_batches(r) for r in range(self.reader.world_size))

    def num_rows(self) -> int:
        return self.reader.num_rows()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = [0] * len(self.consumed)

    def _next_worker(self) -> int:
        """The worker whose batch the DataLoader's round robin hands out next (any, at epoch end)."""
        r = self.reader
        counts = [r._worker_plan(w, len(self.consumed))[1] for w in range(len(self.consumed))]
        active = [w for w, c in enumerate(counts) if self.consumed[w] < c]
        return min(active, key=lambda w: (self.consumed[w], w)) if active else 0

    def __iter__(self) -> Iterator[Batch]:
        r = self.reader
        # Rotate the workers so that a resumed epoch continues the round robin in the same order.
        r.epoch, r.resume, r.rotation = self.epoch, list(self.consumed), self._next_worker()
        loader = torch.utils.data.DataLoader(r, batch_size=None, num_workers=r.num_workers, pin_memory=self.pin_memory,
                                             prefetch_factor=r.options.prefetch_factor if r.num_workers else None)
        for (worker, position), stats, batch in loader:
            self.consumed[worker] = position + 1
            self.stats.update(stats)
            if stats.get("truncated_histories") and not self._warned_truncation:
                self._warned_truncation = True
                logger.warning("histories longer than the group's max_len are cut to the most recent events "
                               "(counted in loader stats 'truncated_histories')")
            if batch is not None:
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "epoch": self.epoch, "consumed": list(self.consumed),
                "stats": dict(self.stats), **self._plan_key()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        for key, value in self._plan_key().items():
            if state.get(key) != value:
                raise ValueError(f"loader state was saved with {key}={state.get(key)!r}, this run has {value!r}; "
                                 f"resume with the same {key} (data.* config) or start the epoch afresh")
        self.epoch = int(state["epoch"])
        self.consumed = [int(c) for c in state["consumed"]]
        self.stats = Counter({k: int(v) for k, v in state["stats"].items()})

    def _plan_key(self) -> dict[str, Any]:
        r = self.reader
        return {"files": [str(f) for f in r.files], "batch_size": r.batch_size, "shuffle": r.shuffle, "seed": r.seed,
                "drop_last": r.drop_last, "rank": r.rank, "world_size": r.world_size,
                "num_workers": r.num_workers, "window_batches": r.options.window_batches,
                "balance": r.options.balance}


def build_loader(files: list[Path], schema: FeatureSchema, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 pin_memory: bool = False, options: LoaderOptions | Mapping[str, Any] | None = None) -> BatchLoader:
    """The training / evaluation loader of one rank (arguments as in :class:`StreamingParquetReader`)."""
    if not isinstance(options, LoaderOptions):
        options = LoaderOptions.from_config(options)
    reader = StreamingParquetReader(files, schema, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                    rank=rank, world_size=world_size, num_workers=num_workers, options=options)
    return BatchLoader(reader, pin_memory=pin_memory)
