"""Checks of files and rows against the gem Parquet layout, and the policy for bad input.

Every check is vectorized over a table and returns *all* offending rows, so that the same code
serves the validator (which reports every violation with its row and column), the
streaming reader (which, per case, fails on the first or skips and counts the rows) and
:func:`check_rows` (which fails on the first: the teacher export).

Cases (keys of ``on_error``; each is ``"fail"`` or ``"skip"``):

======================  ====  =====================================================
case                    unit  what
======================  ====  =====================================================
``unreadable_file``     file  not Parquet, corrupt or truncated (footer or pages)
``layout_version``      file  ``gem.layout_version`` newer than this reader knows
``missing_column``      file  a column of the layout is absent
``schema_mismatch``     file  a column has the wrong Arrow type
``null_value``          row   a null in a label, mask, domain, weight or request id
``id_out_of_range``     row   an id outside ``[0, cardinality)``
``sequence_mismatch``   row   features of one sequence group with unequal lengths
``dense_length``        row   ``dense`` without exactly ``num_dense`` values
``non_finite_dense``    row   NaN or inf in ``dense``
``label_out_of_range``  row   an observed label outside ``[0, 1]`` (or NaN)
``domain_out_of_range`` row   ``domain`` outside ``[0, num_domains)``
``bad_weight``          row   a negative or non-finite weight
``non_finite_teacher``  row   NaN or inf in a ``teacher_<task>`` logit column or in ``teacher_repr``
                              (or a ``teacher_repr`` row of another width than the first)
======================  ====  =====================================================

Beside these cases, the files of one data set must carry the same ``gem.schema`` metadata
(:func:`schema_differences`; compared from the footers only): a file written with another schema
fails with both files and the differing feature named, whatever the policy.

A history longer than its group's ``max_len`` is not an error: the reader keeps the most
recent ``max_len`` events and counts the row in ``truncated_histories``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gem.data.errors import DataError
from gem.data.format.layout import LAYOUT_VERSION, READABLE_VERSIONS, TEACHER_REPR, arrow_schema, is_optional_column
from gem.data.pipeline.schema import FeatureSchema

FILE_CASES = ("unreadable_file", "layout_version", "missing_column", "schema_mismatch")
ROW_CASES = (
    "null_value",
    "id_out_of_range",
    "sequence_mismatch",
    "dense_length",
    "non_finite_dense",
    "label_out_of_range",
    "domain_out_of_range",
    "bad_weight",
    "non_finite_teacher",
)
CASES = FILE_CASES + ROW_CASES

logger = logging.getLogger("gem")


def error_policy(on_error: Mapping[str, str] | None) -> dict[str, str]:
    """``{case: "fail" | "skip"}`` for every case; ``on_error`` may set ``default`` and any case
    (a case set to None, as LoaderOptions' defaults declare them, takes ``default``)."""
    on_error = {k: v for k, v in dict(on_error or {}).items() if v is not None}
    default = on_error.pop("default", "fail")
    for key, value in [("default", default), *on_error.items()]:
        if key not in CASES and key != "default":
            raise ValueError(f"data.loader.on_error.{key}: unknown case; known cases: {list(CASES)} (and 'default')")
        if value not in ("fail", "skip"):
            raise ValueError(f"data.loader.on_error.{key}={value!r}: must be 'fail' or 'skip'")
    return {case: on_error.get(case, default) for case in CASES}


@dataclass
class Violation:
    """One problem: ``row`` is the row in the file (None for a whole-file problem)."""

    case: str
    column: str | None
    row: int | None
    message: str

    def __str__(self) -> str:
        where = ", ".join(
            x
            for x in (
                f"row {self.row}" if self.row is not None else "",
                f"column {self.column!r}" if self.column else "",
            )
            if x
        )
        return f"{where}: {self.message} [{self.case}]" if where else f"{self.message} [{self.case}]"


def file_violations(file_schema: pa.Schema, schema: FeatureSchema) -> list[Violation]:
    """Whole-file problems visible in the footer: layout version, missing columns, wrong types."""
    out = []
    meta = file_schema.metadata or {}
    version = meta.get(b"gem.layout_version", b"1").decode()
    if version not in READABLE_VERSIONS:
        out.append(
            Violation(
                "layout_version",
                None,
                None,
                f"gem.layout_version {version} is not one of {list(READABLE_VERSIONS)}; upgrade gem or "
                f"rewrite the file as layout v{LAYOUT_VERSION}",
            )
        )
    expected = arrow_schema(
        schema, with_weight=True, with_request_id=True, teacher_tasks=schema.tasks, with_teacher_repr=True
    )
    for field in expected:
        if field.name not in file_schema.names:
            if not is_optional_column(field.name):
                out.append(
                    Violation(
                        "missing_column",
                        field.name,
                        None,
                        f"missing; layout v{LAYOUT_VERSION} needs it (gem/data/format/layout.py)",
                    )
                )
            continue
        got = file_schema.field(field.name).type
        if not _compatible(got, field.type):
            out.append(
                Violation(
                    "schema_mismatch",
                    field.name,
                    None,
                    f"has Arrow type {got}, the layout needs {field.type}; cast the column when writing",
                )
            )
    return out


def _compatible(got: pa.DataType, want: pa.DataType) -> bool:
    """Same type, or one that reads losslessly into it (int32 ids into int64, list into large_list)."""
    if got == want:
        return True
    if pa.types.is_list(want) and (pa.types.is_list(got) or pa.types.is_large_list(got)):
        return _compatible(got.value_type, want.value_type)
    if pa.types.is_integer(want):
        return pa.types.is_integer(got)
    if pa.types.is_floating(want):
        return pa.types.is_floating(got)
    return False


def row_violations(table: pa.Table, schema: FeatureSchema) -> list[tuple[str, str, np.ndarray, str]]:
    """Every bad row of ``table`` (layout columns present and typed, checked by file_violations).

    Returns ``(case, column, rows, message)`` with ``rows`` the sorted row indices in ``table``.
    """
    out: list[tuple[str, str, np.ndarray, str]] = []
    num_rows = table.num_rows

    def add(case: str, column: str, bad: np.ndarray, message: str) -> None:
        rows = np.flatnonzero(bad)
        if rows.size:
            out.append((case, column, rows, message))

    def rows_with(lengths: np.ndarray, bad_values: np.ndarray) -> np.ndarray:
        """Per row, whether any of its list values is flagged (``bad_values``: a flag per value)."""
        return np.bincount(np.repeat(np.arange(num_rows), lengths)[bad_values], minlength=num_rows) > 0

    def list_parts(name: str) -> tuple[np.ndarray, np.ndarray]:
        col = table.column(name).combine_chunks()
        offsets = col.offsets.to_numpy()
        lengths = np.diff(offsets).astype(np.int64)
        values = col.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy(zero_copy_only=False)
        return lengths, values

    for name, cardinality in [(f.name, f.cardinality) for f in schema.id_features] + [
        (f.name, f.cardinality) for g in schema.sequence_groups for f in g.features
    ]:
        lengths, values = list_parts(name)
        bad_values = (values < 0) | (values >= cardinality)
        if bad_values.any():
            add(
                "id_out_of_range",
                name,
                rows_with(lengths, bad_values),
                f"an id outside [0, {cardinality}); raise the feature's cardinality in data.schema or remap (hash) "
                f"the ids into range",
            )
    for g in schema.sequence_groups:
        first = table.column(g.features[0].name).combine_chunks()
        for f in g.features[1:]:
            other = table.column(f.name).combine_chunks()
            add(
                "sequence_mismatch",
                f.name,
                np.diff(other.offsets.to_numpy()) != np.diff(first.offsets.to_numpy()),
                f"a different number of events than {g.features[0].name!r}; all features of sequence group "
                f"{g.name!r} need equal lengths",
            )

    lengths, values = list_parts("dense")
    wrong = lengths != schema.num_dense
    add("dense_length", "dense", wrong, f"not exactly data.schema.num_dense={schema.num_dense} values")
    non_finite = ~np.isfinite(values.astype(np.float64, copy=False))
    if non_finite.any():
        add(
            "non_finite_dense",
            "dense",
            rows_with(lengths, non_finite),
            "NaN or inf; clean the data or impute the value",
        )

    def scalar(name: str, dtype) -> np.ndarray:
        col = table.column(name)
        if col.null_count:
            add("null_value", name, col.is_null().to_numpy(zero_copy_only=False), "null; every row needs a value")
            col = col.fill_null(0)
        return col.to_numpy().astype(dtype)

    for task in schema.tasks:
        label = scalar(f"label_{task}", np.float64)
        mask = scalar(f"label_mask_{task}", bool)
        add(
            "label_out_of_range",
            f"label_{task}",
            mask & ~((label >= 0) & (label <= 1)),
            "outside [0, 1]; labels are probabilities or 0/1 (set the label mask to False where unobserved)",
        )
    domain = scalar("domain", np.int64)
    add(
        "domain_out_of_range",
        "domain",
        (domain < 0) | (domain >= schema.num_domains),
        f"outside [0, data.schema.num_domains={schema.num_domains})",
    )
    if "weight" in table.column_names:
        weight = scalar("weight", np.float64)
        add("bad_weight", "weight", ~np.isfinite(weight) | (weight < 0), "negative or not finite; weights are >= 0")
    if "request_id" in table.column_names:
        scalar("request_id", np.int64)
    for task in schema.tasks:
        if f"teacher_{task}" in table.column_names:
            logit = scalar(f"teacher_{task}", np.float64)
            add(
                "non_finite_teacher",
                f"teacher_{task}",
                ~np.isfinite(logit),
                "NaN or inf teacher logit; re-export the teacher's outputs (python -m gem.transfer.export) from a "
                "checkpoint that trained without NaNs",
            )
    if TEACHER_REPR in table.column_names:
        lengths, values = list_parts(TEACHER_REPR)
        width = int(lengths[0]) if num_rows else 0
        add(
            "non_finite_teacher",
            TEACHER_REPR,
            (lengths != width) | (lengths == 0),
            f"not {width} values like the first row; a teacher representation has one width (re-export it)",
        )
        non_finite = ~np.isfinite(values.astype(np.float64, copy=False))
        if non_finite.any():
            add(
                "non_finite_teacher",
                TEACHER_REPR,
                rows_with(lengths, non_finite),
                "NaN or inf in the teacher representation; re-export it (python -m gem.transfer.export) from a "
                "checkpoint that trained without NaNs",
            )
    return out


# -- the gem.schema metadata of the files of one data set ------------------------------------------


def metadata_schema(file_schema: pa.Schema, path: str | Path) -> FeatureSchema | None:
    """The schema in a file's ``gem.schema`` footer metadata, or None when the file has none."""
    raw = (file_schema.metadata or {}).get(b"gem.schema")
    if raw is None:
        return None
    try:
        return FeatureSchema.from_config(json.loads(raw))
    except ValueError as e:  # bad JSON or a malformed schema
        raise DataError(
            f"{path}: its gem.schema metadata is not a valid schema ({e}); rewrite the file with "
            "gem.data.format.layout.write_parquet, or give the schema in config (data.schema)"
        ) from None


def _features(schema: FeatureSchema) -> dict[str, tuple[str, dict[str, Any]]]:
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for f in schema.id_features:
        out[f.name] = ("an id feature", {"cardinality": f.cardinality, "max_ids": f.max_ids, "table": f.table_name})
    for g in schema.sequence_groups:
        for f in g.features:
            out[f.name] = (
                f"a feature of sequence group {g.name!r}",
                {"cardinality": f.cardinality, "table": f.table_name},
            )
    return out


def schema_differences(a: FeatureSchema, b: FeatureSchema) -> list[tuple[str, Any, Any]]:
    """What differs between two schemas, as ``(what, value in a, value in b)``; empty when they
    describe the same data (the order of features, groups and tasks does not matter)."""
    out: list[tuple[str, Any, Any]] = []
    fa, fb = _features(a), _features(b)
    for name in list(fa) + [n for n in fb if n not in fa]:
        if name not in fb or name not in fa:
            out.append(
                (
                    f"feature {name!r} is",
                    fa[name][0] if name in fa else "absent",
                    fb[name][0] if name in fb else "absent",
                )
            )
        elif fa[name][0] != fb[name][0]:
            out.append((f"feature {name!r} is", fa[name][0], fb[name][0]))
        else:
            out += [
                (f"feature {name!r} has {key}", va, fb[name][1][key])
                for key, va in fa[name][1].items()
                if va != fb[name][1][key]
            ]
    ga, gb = {g.name: g.max_len for g in a.sequence_groups}, {g.name: g.max_len for g in b.sequence_groups}
    for name in list(ga) + [n for n in gb if n not in ga]:
        if name in ga and name in gb and ga[name] != gb[name]:
            out.append((f"sequence group {name!r} has max_len", ga[name], gb[name]))
        elif name not in ga or name not in gb:
            out.append(
                (
                    f"sequence group {name!r} is",
                    "present" if name in ga else "absent",
                    "present" if name in gb else "absent",
                )
            )
    if a.num_dense != b.num_dense:
        out.append(("num_dense is", a.num_dense, b.num_dense))
    if sorted(a.tasks) != sorted(b.tasks):
        out.append(("tasks are", list(a.tasks), list(b.tasks)))
    if a.num_domains != b.num_domains:
        out.append(("num_domains is", a.num_domains, b.num_domains))
    return out


def _short(path: Path) -> str:
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def schema_mismatch_message(
    odd: Path, odd_schema: FeatureSchema, ref: Path, ref_schema: FeatureSchema, subject: bool = True
) -> str:
    """``odd`` and ``ref`` carry different gem.schema metadata: name both files, the difference and
    the fix (``subject=False``: for a line that starts with ``odd`` already)."""
    diffs = schema_differences(odd_schema, ref_schema)
    shown = "; ".join(f"{what} {va} in {_short(odd)}, {vb} in {_short(ref)}" for what, va, vb in diffs[:3])
    more = f" (and {len(diffs) - 3} more differences)" if len(diffs) > 3 else ""
    head = (
        f"{odd} and {ref} carry different" if subject else f"its gem.schema differs from {ref}'s; they carry different"
    )
    return (
        f"{head} gem.schema metadata ({shown}{more}); every file of a data set must "
        "be written with one schema: rewrite the odd file with the data set's schema "
        "(gem.data.format.layout.write_parquet) or move it out of the data set"
    )


def check_same_schema(
    path: Path, file_schema: pa.Schema, reference: tuple[Path, FeatureSchema] | None, in_use: FeatureSchema
) -> tuple[Path, FeatureSchema] | None:
    """One file of a reader's list against the first one with gem.schema metadata (``reference``,
    None until found; returned updated). Raises naming both files and the difference; warns once
    when the files' schema is not ``in_use`` (data.schema given in config, or the train split's)."""
    schema = metadata_schema(file_schema, path)
    if schema is None:
        return reference
    if reference is None:
        diffs = schema_differences(schema, in_use)
        if diffs:
            what, va, vb = diffs[0]
            logger.warning(
                "%s: its gem.schema differs from the schema in use (data.schema, or the train split's "
                "files): %s %s in the file, %s in use%s",
                path,
                what,
                va,
                vb,
                f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "",
            )
        return Path(path), schema
    if schema_differences(schema, reference[1]):
        # Name the file that disagrees with the schema in use first, when one of the two agrees.
        ours = (Path(path), schema)
        odd, ref = (reference, ours) if not schema_differences(schema, in_use) else (ours, reference)
        raise DataError(schema_mismatch_message(odd[0], odd[1], ref[0], ref[1]))
    return reference


def check_rows(table: pa.Table, schema: FeatureSchema, where: str) -> None:
    """Raise on the first bad row of ``table`` , naming ``where``, the row, the column and the fix."""
    for case, column, rows, message in row_violations(table, schema):
        row = int(rows[0])
        raise DataError(f"{where}: {Violation(case, column, row, message)}; the row holds {cell(table, column, row)}")


def cell(table: pa.Table, column: str, row: int, limit: int = 8) -> str:
    """The value in ``column`` at ``row``, for an error message; a long list is shortened."""
    value = table.column(column)[row].as_py()
    if isinstance(value, list) and len(value) > limit:
        return f"[{', '.join(map(str, value[:limit]))}, ...] ({len(value)} values)"
    return str(value)
