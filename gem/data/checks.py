"""Checks of files and rows against the gem Parquet layout, and the policy for bad input.

Every check is vectorized over a table and returns *all* offending rows, so that the same code
serves the validator (which reports every violation with its row and column), the
streaming reader (which, per case, fails on the first or skips and counts the rows) and the
reference reader ``ParquetBatchReader`` (which fails on the first).

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
======================  ====  =====================================================

A history longer than its group's ``max_len`` is not an error: the reader keeps the most
recent ``max_len`` events and counts the row in ``truncated_histories``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import pyarrow as pa

from gem.data.parquet import LAYOUT_VERSION, OPTIONAL_COLUMNS, READABLE_VERSIONS, arrow_schema
from gem.data.schema import FeatureSchema

FILE_CASES = ("unreadable_file", "layout_version", "missing_column", "schema_mismatch")
ROW_CASES = ("null_value", "id_out_of_range", "sequence_mismatch", "dense_length", "non_finite_dense",
             "label_out_of_range", "domain_out_of_range", "bad_weight")
CASES = FILE_CASES + ROW_CASES


def error_policy(on_error: Mapping[str, str] | None) -> dict[str, str]:
    """``{case: "fail" | "skip"}`` for every case; ``on_error`` may set ``default`` and any case."""
    on_error = dict(on_error or {})
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
        where = ", ".join(x for x in (f"row {self.row}" if self.row is not None else "",
                                      f"column {self.column!r}" if self.column else "") if x)
        return f"{where}: {self.message} [{self.case}]" if where else f"{self.message} [{self.case}]"


def file_violations(file_schema: pa.Schema, schema: FeatureSchema) -> list[Violation]:
    """Whole-file problems visible in the footer: layout version, missing columns, wrong types."""
    out = []
    meta = file_schema.metadata or {}
    version = meta.get(b"gem.layout_version", b"1").decode()
    if version not in READABLE_VERSIONS:
        out.append(Violation("layout_version", None, None,
                             f"gem.layout_version {version} is not one of {list(READABLE_VERSIONS)}; upgrade gem or "
                             f"rewrite the file as layout v{LAYOUT_VERSION}"))
    expected = arrow_schema(schema, with_weight=True, with_request_id=True)
    for field in expected:
        if field.name not in file_schema.names:
            if field.name not in OPTIONAL_COLUMNS:
                out.append(Violation("missing_column", field.name, None,
                                     f"missing; layout v{LAYOUT_VERSION} needs it (gem/data/parquet.py)"))
            continue
        got = file_schema.field(field.name).type
        if not _compatible(got, field.type):
            out.append(Violation("schema_mismatch", field.name, None,
                                 f"has Arrow type {got}, the layout needs {field.type}; cast the column when writing"))
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

    def list_parts(name: str) -> tuple[np.ndarray, np.ndarray]:
        col = table.column(name).combine_chunks()
        offsets = col.offsets.to_numpy()
        lengths = np.diff(offsets).astype(np.int64)
        values = col.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy(zero_copy_only=False)
        return lengths, values

    for name, cardinality in [(f.name, f.cardinality) for f in schema.id_features] + \
                             [(f.name, f.cardinality) for g in schema.sequence_groups for f in g.features]:
        lengths, values = list_parts(name)
        bad_values = (values < 0) | (values >= cardinality)
        if bad_values.any():
            owner = np.repeat(np.arange(num_rows), lengths)
            add("id_out_of_range", name, np.bincount(owner[bad_values], minlength=num_rows) > 0,
                f"an id outside [0, {cardinality}); raise the feature's cardinality in data.schema or remap (hash) "
                f"the ids into range")
    for g in schema.sequence_groups:
        first = table.column(g.features[0].name).combine_chunks()
        for f in g.features[1:]:
            other = table.column(f.name).combine_chunks()
            add("sequence_mismatch", f.name, np.diff(other.offsets.to_numpy()) != np.diff(first.offsets.to_numpy()),
                f"a different number of events than {g.features[0].name!r}; all features of sequence group "
                f"{g.name!r} need equal lengths")

    lengths, values = list_parts("dense")
    wrong = lengths != schema.num_dense
    add("dense_length", "dense", wrong, f"not exactly data.schema.num_dense={schema.num_dense} values")
    non_finite = ~np.isfinite(values.astype(np.float64, copy=False))
    if non_finite.any():
        owner = np.repeat(np.arange(num_rows), lengths)
        add("non_finite_dense", "dense", np.bincount(owner[non_finite], minlength=num_rows) > 0,
            "NaN or inf; clean the data or impute the value")

    def scalar(name: str, dtype) -> np.ndarray:
        col = table.column(name)
        if col.null_count:
            add("null_value", name, col.is_null().to_numpy(zero_copy_only=False), "null; every row needs a value")
            col = col.fill_null(0)
        return col.to_numpy().astype(dtype)

    for task in schema.tasks:
        label = scalar(f"label_{task}", np.float64)
        mask = scalar(f"label_mask_{task}", bool)
        add("label_out_of_range", f"label_{task}", mask & ~((label >= 0) & (label <= 1)),
            "outside [0, 1]; labels are probabilities or 0/1 (set the label mask to False where unobserved)")
    domain = scalar("domain", np.int64)
    add("domain_out_of_range", "domain", (domain < 0) | (domain >= schema.num_domains),
        f"outside [0, data.schema.num_domains={schema.num_domains})")
    if "weight" in table.column_names:
        weight = scalar("weight", np.float64)
        add("bad_weight", "weight", ~np.isfinite(weight) | (weight < 0), "negative or not finite; weights are >= 0")
    if "request_id" in table.column_names:
        scalar("request_id", np.int64)
    return out
