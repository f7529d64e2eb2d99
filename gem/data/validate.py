"""Validate Parquet files against the gem layout, reporting every violation with row and column.

    python -m gem.data.validate DATA_DIR_OR_FILES... [--max-per-column N]

The schema comes from each file's ``gem.schema`` metadata unless one is given (Python API).
Exit status 1 when any file has a violation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gem.data.checks import Violation, file_violations, row_violations
from gem.data.schema import FeatureSchema


def validate_file(path: str | Path, schema: FeatureSchema | None = None) -> list[Violation]:
    """All violations in ``path`` (rows numbered from 0 within the file), row group by row group."""
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        return [Violation("unreadable_file", None, None, f"not a readable Parquet file ({e}); delete or regenerate it")]
    if schema is None:
        meta = file.schema_arrow.metadata or {}
        if b"gem.schema" not in meta:
            return [Violation("missing_column", None, None, "no gem.schema in the file metadata; pass the schema")]
        schema = FeatureSchema.from_config(json.loads(meta[b"gem.schema"]))
    out = file_violations(file.schema_arrow, schema)
    if out:
        return out
    columns = [c for c in file.schema_arrow.names if c in set(_layout_columns(schema))]
    start = 0
    for rg in range(file.num_row_groups):
        try:
            table = file.read_row_group(rg, columns=columns)
        except (pa.ArrowException, OSError) as e:
            out.append(Violation("unreadable_file", None, start,
                                 f"row group {rg} is corrupt or truncated ({e}); delete or regenerate the file"))
            break
        for case, column, rows, message in row_violations(table, schema):
            out += [Violation(case, column, start + int(r), message) for r in rows]
        start += table.num_rows
    return sorted(out, key=lambda v: (v.row if v.row is not None else -1, v.column or ""))


def _layout_columns(schema: FeatureSchema) -> list[str]:
    from gem.data.parquet import arrow_schema

    return arrow_schema(schema, with_weight=True, with_request_id=True).names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="Parquet files or folders (searched recursively)")
    parser.add_argument("--max-per-column", type=int, default=20, help="print at most this many rows per file and column")
    args = parser.parse_args(argv)
    files = [f for p in map(Path, args.paths) for f in (sorted(p.rglob("*.parquet")) if p.is_dir() else [p])]
    bad = 0
    for f in files:
        violations = validate_file(f)
        bad += bool(violations)
        shown: dict[str | None, int] = {}
        for v in violations:
            shown[v.column] = shown.get(v.column, 0) + 1
            if shown[v.column] <= args.max_per_column:
                print(f"{f}: {v}")
        hidden = sum(max(0, n - args.max_per_column) for n in shown.values())
        if hidden:
            print(f"{f}: ... and {hidden} more")
    print(f"{len(files)} files, {bad} with violations", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
