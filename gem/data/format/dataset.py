"""Data on disk: a data set (a folder of ``train/``, ``val/`` and ``test/`` splits of Parquet files in the
gem layout) or a stream (a folder of ``day=YYYY-MM-DD/`` partitions, ``data.kind=stream``); the files of
a split or partition, the schema the files carry, and the rules of a stream's partitions that training
(gem/data/sources/stream.py) and the validator (gem/data/format/validate.py) share."""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gem.data.errors import DataError, MissingDataError
from gem.data.format.checks import metadata_schema, schema_differences, schema_mismatch_message
from gem.data.pipeline.schema import FeatureSchema

SPLITS = ("train", "val", "test")
PARTITION = re.compile(r"^day=(\d{4}-\d{2}-\d{2})$")  # a stream's partition folder
logger = logging.getLogger("gem")


def make_once(directory: Path, make: Callable[[], object], is_writer: bool, timeout_s: float, what: str) -> Path:
    """``directory``, a data set in a cache, made by ``make()`` (which writes it atomically) if absent.

    Only ``is_writer`` (rank 0) makes it; the other ranks of the run wait for it. Writers hold an
    exclusive lock on ``.<name>.lock`` beside it, so runs that share a cache (a sweep started in
    parallel) make it once: the first makes it, the others wait for the lock and then find it.
    """
    if directory.exists():
        return directory
    if not is_writer:
        wait_for_folder(directory, timeout_s, what)
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(f".{directory.name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        except OSError as e:  # a file system without locks (some network mounts)
            logger.warning("cannot lock %s (%s): runs started together on this cache may each write it", lock.name, e)
        if not directory.exists():
            make()
    return directory


def wait_for_folder(directory: Path, timeout_s: float, what: str) -> None:
    """Block a non-writer rank until rank 0's data set folder appears (written atomically)."""
    deadline = time.monotonic() + timeout_s
    while not directory.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s / 60:.0f} min for rank 0 to {what} {directory}")
        time.sleep(0.5)


def split_files(directory: str | os.PathLike, split: str) -> list[Path]:
    """The ``*.parquet`` files of ``split`` in the data set ``directory``; a missing or empty
    split fails with what was expected, what was found and how to lay the files out."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MissingDataError(
            f"data.dir={str(directory)!r} does not exist; set data.dir to a gem data set: "
            f"a folder with {_expected()} of *.parquet files"
        )
    folder = directory / split
    if not folder.is_dir():
        raise MissingDataError(
            f"data.dir={str(directory)!r} has no {split}/ folder: a gem data set holds "
            f"{_expected()} of *.parquet files, and this folder holds {_found(directory)}; "
            f"{_layout_hint(directory)}"
        )
    files = sorted(folder.glob("*.parquet"))
    if not files:
        raise MissingDataError(
            f"{folder} holds no *.parquet files (it holds {_found(folder)}); put the {split} "
            f"split's Parquet files there (gem layout, docs/data.md; check a data set with "
            f"`python -m gem.data.format.validate {directory}`){_generated_hint(directory)}"
        )
    return files


def _expected() -> str:
    return ", ".join(f"{s}/" for s in SPLITS[:-1]) + f" and {SPLITS[-1]}/ folders"


def _found(folder: Path, limit: int = 8) -> str:
    """What ``folder`` holds, for an error message: its subfolders and a count of its files by suffix."""
    entries = sorted(folder.iterdir())
    if not entries:
        return "nothing"
    dirs = [p.name + "/" for p in entries if p.is_dir()]
    suffixes: dict[str, int] = {}
    for p in entries:
        if not p.is_dir():
            suffixes[p.suffix or p.name] = suffixes.get(p.suffix or p.name, 0) + 1
    parts = []
    if dirs:
        parts.append(f"the folders {dirs[:limit] + (['...'] if len(dirs) > limit else [])}")
    parts += [
        f"{n} {'*' + k if k.startswith('.') else repr(k)} file{'s' if n > 1 else ''}"
        for k, n in sorted(suffixes.items())
    ]
    return ", ".join(parts)


def _layout_hint(directory: Path) -> str:
    if any(directory.glob("*.parquet")):
        return f"move its *.parquet files into {directory / SPLITS[0]}/ and hold some out in " + " and ".join(
            f"{directory / s}/" for s in SPLITS[1:]
        )
    present = [s for s in SPLITS if (directory / s).is_dir()]
    nested = [p for p in sorted(directory.iterdir()) if p.is_dir() and (p / SPLITS[0]).is_dir()]
    if nested and not present:
        return f"it looks like a folder of data sets: set data.dir={str(nested[0])!r}"
    return "write each split's Parquet files (gem layout, docs/data.md) into " + ", ".join(
        f"{directory / s}/" for s in SPLITS
    )


def _generated_hint(directory: Path) -> str:
    """A data set that gem generated into data.cache_dir (synthetic, seqrec) is written atomically;
    one with an empty split was changed by hand, and regenerating it is the fix."""
    if re.fullmatch(r".+-[0-9a-f]{10}", directory.name) and any((directory / s).is_dir() for s in SPLITS):
        return f"; if gem generated this data set into data.cache_dir, delete {directory} to generate it again"
    return ""


def schema_from_files(files: list[Path]) -> FeatureSchema:
    """The schema in the files' ``gem.schema`` metadata, which every file must agree on.

    Reads the footers only. Unreadable files are left to the loader (and its on_error policy) unless
    no file is readable; files without the metadata are checked by their columns there.
    """
    schemas: list[tuple[Path, FeatureSchema]] = []
    unreadable: list[tuple[Path, Exception]] = []
    for f in files:
        try:
            arrow = pq.read_schema(f)
        except (pa.ArrowException, OSError) as e:
            unreadable.append((Path(f), e))
            continue
        schema = metadata_schema(arrow, f)
        if schema is not None:
            schemas.append((Path(f), schema))
    if not schemas and unreadable:  # nothing to read a schema from: the damaged file is the problem
        path, error = unreadable[0]
        others = f" ({len(unreadable)} of {len(files)} files are unreadable)" if len(unreadable) > 1 else ""
        raise DataError(
            f"{path}: not a readable Parquet file, truncated or damaged ({str(error).strip().splitlines()[0]})"
            f"{others}; write it again (or copy it whole), or move it out of the data set"
        )
    if not schemas:
        raise DataError(f"{files[0]}: no gem.schema in the file metadata; give the schema in config (data.schema)")
    groups: list[list[tuple[Path, FeatureSchema]]] = []
    for path, schema in schemas:
        group = next((g for g in groups if not schema_differences(schema, g[0][1])), None)
        if group is None:
            groups.append([(path, schema)])
        else:
            group.append((path, schema))
    if len(groups) > 1:
        groups.sort(key=len, reverse=True)
        (ref, ref_schema), (odd, odd_schema) = groups[0][0], groups[1][0]
        count = (
            f"; {len(schemas) - len(groups[0])} of {len(schemas)} files differ from the other {len(groups[0])}"
            if len(groups[0]) > len(groups[1])
            else ""
        )
        raise DataError(schema_mismatch_message(odd, odd_schema, ref, ref_schema) + count)
    return schemas[0][1]


# -- a stream: day=YYYY-MM-DD partitions ---------------------------------------------------------


def list_partitions(directory: str | os.PathLike) -> list[str]:
    """The partition folders of the stream ``directory`` (``day=YYYY-MM-DD``), oldest first.

    Anything else in the folder that is not hidden is an error naming it: a stray folder would
    otherwise be skipped silently, or read in the wrong place."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MissingDataError(
            f"data.dir={directory} does not exist; a stream is a folder of day=YYYY-MM-DD/ partitions"
        )
    dates = {}
    for p in directory.iterdir():
        if p.name.startswith((".", "_")):
            continue
        m = PARTITION.match(p.name)
        if not p.is_dir() or m is None:
            raise DataError(
                f"data.dir={directory}: {p.name!r} is not a partition folder day=YYYY-MM-DD; move it out of "
                "data.dir (a stream holds only its partitions)"
            )
        try:
            dates[p.name] = datetime.date.fromisoformat(m.group(1))
        except ValueError as e:
            raise DataError(f"data.dir={directory}: partition {p.name!r} has no valid date ({e}); rename it") from None
    if not dates:
        raise MissingDataError(f"data.dir={directory} holds no day=YYYY-MM-DD/ partition folders")
    return sorted(dates, key=dates.get)


def is_stream(directory: Path) -> bool:
    """Whether ``directory`` looks like a stream: a folder holding a ``day=...`` entry."""
    return directory.is_dir() and any(p.name.startswith("day=") for p in directory.iterdir())


def missing_days(partitions: list[str]) -> list[tuple[str, str]]:
    """The days missing between the first and the last of ``partitions`` (as :func:`list_partitions`
    returns them), as ``(first missing, last missing)`` partition names, one pair per gap."""
    days = [datetime.date.fromisoformat(PARTITION.match(p).group(1)) for p in partitions]
    one = datetime.timedelta(days=1)
    return [(f"day={a + one}", f"day={b - one}") for a, b in zip(days, days[1:]) if b - a > one]


def gaps_message(directory: str | os.PathLike, partitions: list[str]) -> str | None:
    """One line naming the days missing in the middle of a stream, or None when it has no gap."""
    gaps = missing_days(partitions)
    if not gaps:
        return None
    count = sum((datetime.date.fromisoformat(b[4:]) - datetime.date.fromisoformat(a[4:])).days + 1 for a, b in gaps)
    listed = ", ".join(a if a == b else f"{a}..{b}" for a, b in gaps[:6]) + (" ..." if len(gaps) > 6 else "")
    return (
        f"data.dir={directory}: {count} day(s) missing between {partitions[0]} and {partitions[-1]}: {listed}; "
        "the stream trains on the days it holds, and a missing day that arrives after a run has trained "
        "past it stops the next run (partitions out of order): add it before training past it"
    )


def resume_problem(directory: str | os.PathLike, partitions: list[str], saved: str | None, before: int) -> str | None:
    """What stops a stream run from resuming at partition ``saved``, which had ``before`` partitions
    before it when the checkpoint was written, now that ``directory`` holds ``partitions``; None when
    that partition is still in its place. The stream trains forward only."""
    if before >= len(partitions):
        return (
            f"data.dir={directory}: the checkpoint stands in partition {before + 1}, but data.dir holds "
            f"{len(partitions)}; put the removed partitions back, or start a new run (a new checkpoint.dir)"
        )
    if partitions[before] == saved:
        return None
    if saved not in partitions:
        return (
            f"data.dir={directory}: the checkpoint stands in partition {saved}, which is no longer there "
            f"(the partitions now run from {partitions[0]} to {partitions[-1]}); put it back, or start a new run "
            "(a new checkpoint.dir)"
        )
    now = partitions.index(saved)
    listed = ", ".join(partitions[:now][:6]) + (" ..." if now > 6 else "")
    change = "a partition dated before it appeared" if now > before else "partitions before it were removed"
    return (
        f"data.dir={directory}: partitions out of order: the checkpoint stands in {saved}, which had "
        f"{before} partition(s) before it, now {now} ({listed}): {change}. The stream trains forward "
        "only: move the partitions dated before it out of data.dir (or put the removed ones back), or train "
        "them in a new run"
    )
