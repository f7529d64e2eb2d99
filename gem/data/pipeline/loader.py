"""The training / evaluation loader: a DataLoader over the one Parquet reader
(gem/data/format/reader.py) that knows where it stands, so a checkpoint resumes the epoch at the
next unconsumed batch."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gem.data.format.reader import LoaderOptions, StreamingParquetReader
from gem.data.pipeline.batch import Batch
from gem.data.pipeline.schema import FeatureSchema

logger = logging.getLogger("gem")

STATE_VERSION = 1


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
        loader = torch.utils.data.DataLoader(
            r,
            batch_size=None,
            num_workers=r.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=r.options.prefetch_factor if r.num_workers else None,
        )
        for (worker, position), stats, batch in loader:
            self.consumed[worker] = position + 1
            self.stats.update(stats)
            if stats.get("truncated_histories") and not self._warned_truncation:
                self._warned_truncation = True
                logger.warning(
                    "histories longer than the group's max_len are cut to the most recent events "
                    "(counted in loader stats 'truncated_histories')"
                )
            if batch is not None:
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": list(self.consumed),
            "stats": dict(self.stats),
            **self._plan_key(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        for key, value in self._plan_key().items():
            if state.get(key) != value:
                raise ValueError(
                    f"loader state was saved with {key}={state.get(key)!r}, this run has {value!r}; "
                    f"resume with the same {key} (data.* config) or start the epoch afresh"
                )
        self.epoch = int(state["epoch"])
        self.consumed = [int(c) for c in state["consumed"]]
        self.stats = Counter({k: int(v) for k, v in state["stats"].items()})

    def _plan_key(self) -> dict[str, Any]:
        r = self.reader
        return {
            "files": [str(f) for f in r.files],
            "batch_size": r.batch_size,
            "shuffle": r.shuffle,
            "seed": r.seed,
            "drop_last": r.drop_last,
            "rank": r.rank,
            "world_size": r.world_size,
            "num_workers": r.num_workers,
            "window_batches": r.options.window_batches,
            "balance": r.options.balance,
        }


def build_loader(
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
    pin_memory: bool = False,
    options: LoaderOptions | Mapping[str, Any] | None = None,
) -> BatchLoader:
    """The training / evaluation loader of one rank (arguments as in :class:`StreamingParquetReader`)."""
    if not isinstance(options, LoaderOptions):
        options = LoaderOptions.from_config(options)
    reader = StreamingParquetReader(
        files,
        schema,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        options=options,
    )
    return BatchLoader(reader, pin_memory=pin_memory)
