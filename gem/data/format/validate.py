"""Validate Parquet files against the gem layout, reporting every violation with row and column.

    python -m gem.data.format.validate DATA_DIR_OR_FILES... [--max-per-column N]

The schema comes from each file's ``gem.schema`` metadata unless one is given (Python API);
every file must carry the same one. A data set folder (with train/, val/ and test/) must hold
every split. Exit status 1 when any file has a violation, a split or path is missing or empty,
or no file was found.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gem.data.format.checks import (
    Violation,
    file_violations,
    metadata_schema,
    row_violations,
    schema_differences,
    schema_mismatch_message,
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
    parser.add_argument("paths", nargs="+", help="Parquet files or folders (searched recursively)")
    parser.add_argument(
        "--max-per-column", type=int, default=20, help="print at most this many rows per file and column"
    )
    args = parser.parse_args(argv)
    files, missing = collect_files([Path(p) for p in args.paths])
    for problem in missing:
        print(problem)
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
        + (f", {len(missing)} missing or empty folders" if missing else ""),
        file=sys.stderr,
    )
    return 1 if bad or missing or not files else 0


def collect_files(paths: list[Path]) -> tuple[list[Path], list[str]]:
    """The Parquet files under ``paths`` and a message per missing path, empty folder or missing split.

    A folder with any of the split folders (train/, val/, test/) is a data set: each split must
    be there and hold files. Any other folder must hold at least one ``*.parquet`` file."""
    from gem.data.format.dataset import SPLITS, _found

    files: list[Path] = []
    problems: list[str] = []
    for p in paths:
        if not p.exists():
            problems.append(
                f"{p}: does not exist; give a data set folder (with train/, val/ and test/), a split folder "
                "or Parquet files"
            )
            continue
        if not p.is_dir():
            files.append(p)
            continue
        found = sorted(p.rglob("*.parquet"))
        splits = [s for s in SPLITS if (p / s).is_dir()]
        if splits:
            for s in SPLITS:
                if s not in splits:
                    problems.append(
                        f"{p}: no {s}/ folder; a gem data set holds train/, val/ and test/ folders of "
                        f"*.parquet files (this one holds {_found(p)}); add the {s} split's files in {p / s}/"
                    )
                elif not any((p / s).rglob("*.parquet")):
                    problems.append(
                        f"{p / s}: holds no *.parquet files (it holds {_found(p / s)}); put the {s} "
                        "split's Parquet files there"
                    )
        elif not found:
            problems.append(
                f"{p}: holds no *.parquet files (it holds {_found(p)}); give a data set folder (with "
                "train/, val/ and test/ folders of *.parquet files), a split folder or Parquet files"
            )
        files += found
    return files, problems


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
