"""The gem Parquet layout (version 2; version 1 files stay readable): its columns, types and metadata.

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
``teacher_<k>``      ``float32`` (optional)      a teacher model's logit for task k
                                                 (knowledge transfer, docs/transfer.md)
``teacher_repr``     ``list<float32>`` (optional)  a teacher's representation of the example, the
                                                 same width in every row and file
===================  ==========================  ==============================================

Version 2 added ``request_id``; a version 1 file is a version 2 file without it.

The file's key-value metadata carries ``gem.layout_version`` (``"2"``) and ``gem.schema`` (the
schema as JSON). A data set directory holds ``train/``, ``val/`` and ``test/`` folders of
``*.parquet`` files.

The one reader is ``StreamingParquetReader`` (gem/data/format/reader.py: sharded, shuffled,
token-balanced, resumable, with a per-case bad-input policy); it checks files and rows with
gem/data/format/checks.py, which imports the layout from here (never the other way).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gem.data.pipeline.schema import FeatureSchema

LAYOUT_VERSION = "2"
READABLE_VERSIONS = ("1", "2")
OPTIONAL_COLUMNS = ("weight", "request_id")
TEACHER_PREFIX = "teacher_"  # optional ``teacher_<task>`` float32 columns: a teacher's logits
TEACHER_REPR = "teacher_repr"  # optional list<float32> column: a teacher's representation of the example


def teacher_columns(schema: FeatureSchema) -> list[str]:
    """The optional teacher-logit column of every task of ``schema``."""
    return [f"{TEACHER_PREFIX}{t}" for t in schema.tasks]


def is_optional_column(name: str) -> bool:
    return name in OPTIONAL_COLUMNS or name.startswith(TEACHER_PREFIX)


def arrow_schema(
    schema: FeatureSchema,
    with_weight: bool = False,
    with_request_id: bool = False,
    teacher_tasks: tuple[str, ...] | list[str] = (),
    with_teacher_repr: bool = False,
) -> pa.Schema:
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
    fields += [pa.field(f"{TEACHER_PREFIX}{t}", pa.float32()) for t in schema.tasks if t in teacher_tasks]
    if with_teacher_repr:
        fields.append(pa.field(TEACHER_REPR, pa.list_(pa.float32())))
    metadata = {"gem.layout_version": LAYOUT_VERSION, "gem.schema": json.dumps(schema.to_config())}
    return pa.schema(fields, metadata=metadata)


def write_parquet(table: pa.Table, path: str | Path, schema: FeatureSchema, row_group_size: int = 8192) -> None:
    """Write ``table`` (columns as in the module docstring) atomically to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = arrow_schema(
        schema,
        with_weight="weight" in table.column_names,
        with_request_id="request_id" in table.column_names,
        teacher_tasks=present_teachers(table.column_names, schema),
        with_teacher_repr=TEACHER_REPR in table.column_names,
    )
    missing = [n for n in target.names if n not in table.column_names]
    if missing:
        raise ValueError(f"write_parquet: the table lacks columns {missing} of the gem layout v{LAYOUT_VERSION}")
    table = table.select(target.names).cast(target)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    tmp.replace(path)


def present_teachers(names, schema: FeatureSchema) -> tuple[str, ...]:
    """The tasks of ``schema`` whose ``teacher_<task>`` column is among ``names``."""
    return tuple(t for t in schema.tasks if f"{TEACHER_PREFIX}{t}" in names)
