"""Validate Parquet files against the gem layout, reporting every violation with row and column.

    python -m gem.data.format.validate DATA_DIR_OR_FILES... [--max-per-column N] [--checkpoint STEP_DIR]

The schema comes from each file's ``gem.schema`` metadata unless one is given (Python API);
every file must carry the same one. A folder is checked as training reads it:

- a data set (a folder with any of train/, val/, test/): its splits are the ``*.parquet`` files
  directly in each split folder. A missing or empty train/ or test/ split, or one whose files hold
  no rows, fails (the run would refuse it); a missing or empty val/ split warns (the run trains
  without validation);
- a stream (a folder of ``day=YYYY-MM-DD/`` partitions, ``data.kind=stream``): the partition rules
  training applies (gem/data/format/dataset.py: names, dates, stray entries), each partition with
  files and rows; days missing between the first and the last warn. ``--checkpoint`` (a stream
  run's ``step_N`` folder, or its checkpoints/ or run folder for the newest) also checks that the
  partitions still let that run resume (order: none inserted before, none removed);
- any other folder: every ``*.parquet`` file below it.

Parquet files in a data set or stream folder that training does not read are named in a warning.
Exit status 1 when any file has a violation, the layout has a problem, a path is missing, or no
file was found; warnings alone leave it 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gem.data.errors import DataError, MissingDataError
from gem.data.format.checks import (
    Violation,
    file_violations,
    metadata_schema,
    row_violations,
    schema_differences,
    schema_mismatch_message,
)
from gem.data.format.dataset import (
    SPLITS,
    _found,
    gaps_message,
    is_stream,
    list_partitions,
    resume_problem,
    split_files,
)
from gem.data.pipeline.schema import FeatureSchema


def validate_file(path: str | Path, schema: FeatureSchema | None = None) -> list[Violation]:
    """All violations in ``path`` (rows numbered from 0 within the file), row group by row group."""
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        return [Violation("unreadable_file", None, None, f"not a readable Parquet file ({e}); delete or regenerate it")]
    if schema is None:
        try:
            schema = metadata_schema(file.schema_arrow, path)
        except ValueError as e:
            return [Violation("schema_mismatch", None, None, str(e).removeprefix(f"{path}: "))]
        if schema is None:
            return [Violation("missing_column", None, None, "no gem.schema in the file metadata; pass the schema")]
    out = file_violations(file.schema_arrow, schema)
    if out:
        return out
    columns = [c for c in file.schema_arrow.names if c in set(_layout_columns(schema))]
    start = 0
    for rg in range(file.num_row_groups):
        try:
            table = file.read_row_group(rg, columns=columns)
        except (pa.ArrowException, OSError) as e:
            out.append(
                Violation(
                    "unreadable_file",
                    None,
                    start,
                    f"row group {rg} is corrupt or truncated ({e}); delete or regenerate the file",
                )
            )
            break
        for case, column, rows, message in row_violations(table, schema):
            out += [Violation(case, column, start + int(r), message) for r in rows]
        start += table.num_rows
    return sorted(out, key=lambda v: (v.row if v.row is not None else -1, v.column or ""))


def _layout_columns(schema: FeatureSchema) -> list[str]:
    from gem.data.format.layout import arrow_schema

    return arrow_schema(schema, with_weight=True, with_request_id=True, teacher_tasks=schema.tasks).names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="Parquet files or folders (a data set, a stream, any folder)")
    parser.add_argument(
        "--max-per-column", type=int, default=20, help="print at most this many rows per file and column"
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="a stream run's checkpoint (a step_N folder, or its checkpoints/ or run folder: the newest): check "
        "that the stream's partitions still let it resume",
    )
    args = parser.parse_args(argv)
    layout = collect([Path(p) for p in args.paths], args.checkpoint)
    files = layout.files
    for problem in layout.problems:
        print(problem)
    for warning in layout.warnings:
        print(f"warning: {warning}")
    bad = 0
    outliers = schema_outliers(files)
    for f in files:
        violations = ([outliers[f]] if f in outliers else []) + validate_file(f)
        bad += bool(violations)
        shown: dict[str | None, int] = {}
        for v in violations:
            shown[v.column] = shown.get(v.column, 0) + 1
            if shown[v.column] <= args.max_per_column:
                print(f"{f}: {v}")
        hidden = sum(max(0, n - args.max_per_column) for n in shown.values())
        if hidden:
            print(f"{f}: ... and {hidden} more")
    print(
        f"{len(files)} files, {bad} with violations"
        + (f", {len(layout.problems)} layout problem(s)" if layout.problems else "")
        + (f", {len(layout.warnings)} warning(s)" if layout.warnings else ""),
        file=sys.stderr,
    )
    return 1 if bad or layout.problems or not files else 0


@dataclass
class Layout:
    """What the paths hold as training reads them: the files to validate, the problems that fail
    (a run would refuse them) and the warnings (a run goes on, and says so)."""

    files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def collect(paths: list[Path], checkpoint: Path | None = None) -> Layout:
    """The Parquet files under ``paths``, each folder checked as a data set, a stream or a plain
    folder of Parquet files (the module docstring); ``checkpoint``: a stream run's, whose resume
    each stream is checked against."""
    out = Layout()
    streams = 0
    for p in paths:
        if not p.exists():
            out.problems.append(
                f"{p}: does not exist; give a data set folder (with train/, val/ and test/), a stream folder "
                "(day=YYYY-MM-DD/ partitions), a split folder or Parquet files"
            )
        elif not p.is_dir():
            out.files.append(p)
        elif any((p / s).is_dir() for s in SPLITS):
            _collect_dataset(p, out)
        elif is_stream(p):
            streams += 1
            _collect_stream(p, out, checkpoint)
        else:
            found = sorted(p.rglob("*.parquet"))
            if not found:
                out.problems.append(
                    f"{p}: holds no *.parquet files (it holds {_found(p)}); give a data set folder (with "
                    "train/, val/ and test/ folders of *.parquet files), a split folder or Parquet files"
                )
            out.files += found
    if checkpoint is not None and not streams:
        out.problems.append(
            f"--checkpoint {checkpoint}: checks a stream's partitions, and no stream folder (day=YYYY-MM-DD/ "
            "partitions) was given"
        )
    return out


def _rows(files: list[Path]) -> int | None:
    """The rows the files' footers count, or None when one of them is unreadable (reported per file)."""
    total = 0
    for f in files:
        try:
            total += pq.read_metadata(f).num_rows
        except (pa.ArrowException, OSError):
            return None
    return total


def _collect_dataset(p: Path, out: Layout) -> None:
    """A data set: the files of each split as training lists them (split_files), with what a run
    refuses (a missing, empty or zero-row train/ or test/) and what it warns of (the same of val/)."""
    for s in SPLITS:
        report = out.warnings if s == "val" else out.problems
        if not (p / s).is_dir():
            if s == "val":
                report.append(
                    f"{p}: no val/ folder; training runs without validation (it warns, and "
                    f"trainer.best_metric fails): add the val split's files in {p / s}/ to validate"
                )
            else:
                report.append(
                    f"{p}: no {s}/ folder; a gem data set holds train/, val/ and test/ folders of "
                    f"*.parquet files (this one holds {_found(p)}); add the {s} split's files in {p / s}/"
                )
            continue
        files = sorted((p / s).glob("*.parquet"))
        if not files:
            report.append(
                f"{p / s}: holds no *.parquet files (it holds {_found(p / s)}); put the {s} split's Parquet files there"
            )
            continue
        out.files += files
        if _rows(files) == 0:
            report.append(
                {
                    "train": f"{p / s}: its {len(files)} file(s) hold no rows; training refuses an empty training "
                    "split: write the examples into its files",
                    "val": f"{p / s}: its {len(files)} file(s) hold no rows; training runs without validation (it "
                    "warns, and trainer.best_metric fails): write examples there to validate",
                    "test": f"{p / s}: its {len(files)} file(s) hold no rows; training refuses to end on NaN test "
                    "metrics: write examples there, or train with trainer.test=false",
                }[s]
            )
    _unread(p, out)


def _collect_stream(p: Path, out: Layout, checkpoint: Path | None) -> None:
    """A stream: training's partition rules (list_partitions, split_files), a partition without rows
    (the run stops there), the days missing in the middle (a warning), and with ``checkpoint`` the
    order that run's resume needs (resume_problem)."""
    try:
        partitions = list_partitions(p)
    except DataError as e:
        out.problems.append(str(e))
        out.files += sorted(p.rglob("*.parquet"))
        return
    gaps = gaps_message(p, partitions)
    if gaps:
        out.warnings.append(gaps)
    for partition in partitions:
        try:
            files = split_files(p, partition)
        except MissingDataError as e:
            out.problems.append(str(e))
            continue
        out.files += files
        if _rows(files) == 0:
            out.problems.append(
                f"{p / partition}: its {len(files)} file(s) hold no rows; a stream run scores each partition "
                "before training on it and stops at one without examples: write its examples, or move it out of "
                "the stream"
            )
    if checkpoint is not None:
        try:
            where, state = _resume_state(checkpoint)
        except DataError as e:
            out.problems.append(str(e))
            return
        problem = resume_problem(p, partitions, state.get("partition"), int(state.get("partitions_before", 0)))
        if problem:
            out.problems.append(f"{problem} (checkpoint {where})")
    _unread(p, out)


def _unread(p: Path, out: Layout) -> None:
    """One warning for the Parquet files under the data set or stream ``p`` that training does not read."""
    listed = set(out.files)
    unread = [f for f in sorted(p.rglob("*.parquet")) if f not in listed]
    if unread:
        out.warnings.append(
            f"{p}: {len(unread)} *.parquet file(s) that training does not read (e.g. {unread[0]}): a split or "
            "partition is the *.parquet files directly in its folder; move them there, or out of the data"
        )


_STEP = re.compile(r"^step_\d+$")


def _resume_state(path: Path) -> tuple[Path, dict]:
    """The loader state of rank 0 in the checkpoint ``path`` (a step_N folder, or a folder of them, or
    the run folder that holds checkpoints/: the newest), as a stream run saves it: ``partition`` and
    ``partitions_before``."""
    if not (path / "loader_rank0.json").is_file():
        steps = sorted(
            q
            for folder in (path, path / "checkpoints")  # a checkpoints/ folder, or the run folder above it
            for q in folder.glob("step_*")
            if _STEP.match(q.name) and (q / "loader_rank0.json").is_file()
        )
        if not steps:
            raise DataError(
                f"--checkpoint {path}: neither it nor a step_N folder in it holds loader_rank0.json; give a "
                "checkpoint of a data.kind=stream run (runs/<name>/checkpoints/step_N)"
            )
        path = steps[-1]
    try:
        state = json.loads((path / "loader_rank0.json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"--checkpoint {path}: loader_rank0.json is not readable ({e})") from None
    if not isinstance(state, dict) or "partition" not in state:
        raise DataError(
            f"--checkpoint {path}: not the checkpoint of a stream run (its loader state names no partition)"
        )
    return path, state


def schema_outliers(files: list[Path]) -> dict[Path, Violation]:
    """A violation for every file whose gem.schema metadata differs from the one most files carry
    (footers only; files without the metadata or unreadable ones are left to validate_file)."""
    groups: list[list[tuple[Path, FeatureSchema]]] = []
    for path in files:
        try:
            schema = metadata_schema(pq.read_schema(path), path)
        except (pa.ArrowException, OSError, ValueError):
            continue
        if schema is None:
            continue
        group = next((g for g in groups if not schema_differences(schema, g[0][1])), None)
        if group is None:
            groups.append([(path, schema)])
        else:
            group.append((path, schema))
    if len(groups) < 2:
        return {}
    majority = max(groups, key=len)  # the first found among equals
    ref, ref_schema = majority[0]
    return {
        path: Violation(
            "schema_mismatch", None, None, schema_mismatch_message(path, schema, ref, ref_schema, subject=False)
        )
        for g in groups
        if g is not majority
        for path, schema in g
    }


if __name__ == "__main__":
    sys.exit(main())
