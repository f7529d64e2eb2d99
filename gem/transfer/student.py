"""A student that reads its teacher's outputs: representation transfer and the adapter.

``trainer.distill.representation=P`` (P > 0): the student's dense arch also reads the teacher's
representation of each example (``Batch.teacher_repr [B, R]``: the Parquet column
``teacher_repr`` that ``python -m gem.transfer.export transfer.representation=heads|history``
writes, or the online teacher's head input), through a learned projection to ``P`` values appended
to its dense features. The student reads either kind the same way; which one a data set holds is
in its files' ``gem.teacher_repr`` metadata (:func:`representation_kind`).

``trainer.distill.adapter=true``: the student corrects the teacher instead of replacing it. Its
logits are ``a * t + g * r`` per task, with ``t`` the teacher's logits (``Batch.teacher``, appended
to the student's dense features as well), ``r`` the student arch's output and ``a`` (1 at init),
``g`` (0 at init) learned: it starts as the teacher and learns, from fresh labels, where the
teacher is stale (trained on older data). The teacher's logits are then needed at serving too.

Data flow (``num_dense`` grows by ``P`` and, with the adapter, by ``K``)::

    teacher_repr [B, R] --linear--> [B, P] ---+
    teacher logits t [B, K] (adapter) --------+--> cat with dense [B, num_dense] --> student arch --> r [B, K]
    logits = a * t + g * r  (adapter)  |  r

:func:`wrap_dense` builds it (the trainer's model build); :func:`prepare_teacher` checks the data
set's teacher columns (``source=data``) or attaches an online teacher that fills ``batch.teacher``
/ ``batch.teacher_repr`` before each forward (``source=model``), in training and evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from gem.data.errors import DataError
from gem.data.pipeline.schema import FeatureSchema
from gem.models.capabilities import Capabilities, capabilities
from gem.sparse.arch import SparseOutput
from gem.train.checkpoint import CheckpointError

REPR_COLUMN = "teacher_repr"


class TransferStudent(nn.Module):
    """A student's dense arch reading the teacher's representation and / or correcting its logits.

    Args:
        build: ``build(schema=..., feature_dims=...)`` -> the student's own dense arch (a DLRM, a
            narrow GEM); it gets a schema whose ``num_dense`` includes the appended inputs.
        schema / feature_dims: the data's schema and the SparseArch's widths.
        representation_in: ``R``, the width of the teacher's representation (0: not read).
        representation_dim: ``P``, the width it is projected to.
        adapter: the logits are ``a * teacher + g * student`` (module docstring).
    """

    def __init__(
        self,
        build: Callable[..., nn.Module],
        schema: FeatureSchema,
        feature_dims: dict[str, int],
        representation_in: int = 0,
        representation_dim: int = 0,
        adapter: bool = False,
    ) -> None:
        super().__init__()
        num_tasks = len(schema.tasks)
        self.representation_in = representation_in if representation_dim else 0
        self.adapter = adapter
        self.project = nn.Linear(representation_in, representation_dim) if self.representation_in else None
        extra = (representation_dim if self.project is not None else 0) + (num_tasks if adapter else 0)
        self.student = build(
            schema=dataclasses.replace(schema, num_dense=schema.num_dense + extra), feature_dims=feature_dims
        )
        # GEMModel passes teacher= / teacher_repr=; a FLOP count when the student arch has one
        self.capabilities = Capabilities(teacher_inputs=True, counts_flops=capabilities(self.student).counts_flops)
        if adapter:
            self.teacher_scale = nn.Parameter(torch.empty(num_tasks))
            self.student_gate = nn.Parameter(torch.empty(num_tasks))

    def init_weights(self) -> None:
        self.student.init_weights()
        if self.project is not None:
            nn.init.xavier_uniform_(self.project.weight)
            nn.init.zeros_(self.project.bias)
        if self.adapter:
            nn.init.ones_(self.teacher_scale)
            nn.init.zeros_(self.student_gate)

    def flops(self, batch_size: int, *args, **kwargs) -> dict[str, int]:
        """The student arch's analytic FLOP count plus the projection's: what the trainer logs as
        TFLOP/s (declared, ``capabilities.counts_flops``, when the student arch counts its own). The
        appended inputs' share of the student's first layer is in its own."""
        out = dict(self.student.flops(batch_size, *args, **kwargs))
        if self.project is not None:
            extra = 2 * batch_size * self.project.in_features * self.project.out_features
            out["forward"] += extra
            out["backward"] += extra  # the weight gradient (its input, the teacher's, needs none)
        return out

    def forward(
        self,
        sparse: SparseOutput,
        dense: torch.Tensor,
        domain: torch.Tensor,
        teacher: torch.Tensor | None = None,
        teacher_repr: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = [dense]
        if self.project is not None:
            if teacher_repr is None or teacher_repr.shape[1] != self.representation_in:
                got = "none" if teacher_repr is None else f"width {teacher_repr.shape[1]}"
                raise DataError(
                    f"trainer.distill.representation: the student reads a teacher representation of width "
                    f"{self.representation_in}, the batch has {got}; train on data exported with "
                    f"transfer.representation=heads|history by the same teacher, or use trainer.distill.source=model"
                )
            inputs.append(self.project(teacher_repr.to(dense.dtype)))
        if self.adapter:
            if teacher is None:
                raise DataError(
                    "trainer.distill.adapter: the batch has no teacher logits; train on data exported by "
                    "python -m gem.transfer.export, or use trainer.distill.source=model"
                )
            inputs.append(teacher.to(dense.dtype))
        out = self.student(sparse, torch.cat(inputs, dim=1), domain)
        if self.adapter:
            return self.teacher_scale * teacher.to(out.dtype) + self.student_gate * out
        return out


def uses_teacher(config) -> bool:
    """Whether ``trainer.distill`` asks for the teacher's outputs at all."""
    dd = config.trainer.distill
    return dd.weight > 0 or dd.representation > 0 or dd.adapter


def needed_tasks(config, schema: FeatureSchema) -> list[str]:
    """The tasks whose teacher logits the run needs: the distilled ones, every task with the adapter."""
    from gem.train.config import ConfigError

    dd = config.trainer.distill
    unknown = [k for k in dd.tasks if k not in schema.tasks]
    if unknown:
        raise ConfigError(f"trainer.distill.tasks: {unknown} are not tasks of the data ({list(schema.tasks)})")
    if dd.adapter:
        return list(schema.tasks)
    return (list(dd.tasks) or list(schema.tasks)) if dd.weight > 0 else []


def representation_width(config, schema: FeatureSchema) -> int:
    """``R``, the width of the teacher's representation: from the first training file's
    ``teacher_repr`` column (``source=data``) or from the teacher's checkpoint (``source=model``)."""
    dd = config.trainer.distill
    if dd.source == "model":
        return teacher_representation_dim(dd.checkpoint, schema)
    import pyarrow.parquet as pq

    from gem.data.format.dataset import split_files

    if config.data.kind != "parquet":
        raise DataError(
            f"trainer.distill.representation with source=data needs data.kind=parquet (a data set the "
            f"teacher export wrote, with a {REPR_COLUMN} column), not data.kind={config.data.kind}; or use "
            "trainer.distill.source=model"
        )
    files = split_files(config.data.dir, "train")
    if not files:
        raise DataError(f"trainer.distill.representation: no training files under data.dir={config.data.dir}")
    file = pq.ParquetFile(files[0])
    if REPR_COLUMN not in file.schema_arrow.names:
        raise DataError(missing_columns_message(files[0], [REPR_COLUMN]))
    first = file.read_row_group(0, columns=[REPR_COLUMN]).column(REPR_COLUMN)
    from gem.train.logging import logger

    logger.info("trainer.distill.representation: the data's teacher_repr is %s", representation_kind(files[0]))
    return len(first[0]) if len(first) else 0


def representation_kind(path) -> dict:
    """What the ``teacher_repr`` column of the Parquet file ``path`` holds, from its ``gem.teacher_repr``
    metadata: ``{"kind": "heads" | "history", "candidate_features": [...], "width": R}``
    (``{"kind": "unknown"}`` for a file written without it)."""
    import json

    import pyarrow.parquet as pq

    from gem.transfer.export import META_KEY

    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[META_KEY]) if META_KEY in meta else {"kind": "unknown"}


def teacher_representation_dim(checkpoint: str, student: FeatureSchema) -> int:
    """The width of the representation the teacher of ``checkpoint`` hands its heads (its top MLP's
    output), from its config, with its dense arch built on the meta device (nothing is read). Its
    schema: its config's ``data.schema``, else (a Parquet data set's, read from the files) the student's."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from gem.sparse.arch import SparseArch
    from gem.train.initialize import resolve_checkpoint
    from gem.transfer.teacher import checkpoint_config, teacher_schema

    path = resolve_checkpoint(checkpoint, "trainer.distill.checkpoint")
    config = checkpoint_config(path)
    schema = teacher_schema(config, student, f"trainer.distill.checkpoint={path}")
    s = config.sparse
    arch = SparseArch.from_config(schema, s.embedding_dim, s.init_scale, s.dims, s.backend, device="meta")
    dims = {f: arch.pooled_dim(f) for f in schema.id_feature_names}
    dims.update({g.name: arch.sequence_dim(g.name) for g in schema.sequence_groups})
    model = OmegaConf.create(config.model)
    if "attention_backend" in model:
        model.attention_backend = None
    with torch.device("meta"):
        dense = instantiate(model, _partial_=True, _convert_="all")(schema=schema, feature_dims=dims)
    if not capabilities(dense).head_representation:
        raise CheckpointError(
            f"trainer.distill.checkpoint={path}: the teacher's dense arch {type(dense).__name__} has no top MLP "
            "(`top.out_dim`) whose output is the representation its heads read"
        )
    return int(dense.top.out_dim)


def wrap_dense(config, schema: FeatureSchema, feature_dims: dict[str, int], build: Callable[..., nn.Module]):
    """The student's dense arch: ``build(schema=, feature_dims=)`` itself, or a :class:`TransferStudent`
    around it when ``trainer.distill.representation`` / ``adapter`` is on."""
    dd = config.trainer.distill
    if not (dd.representation > 0 or dd.adapter):
        return build(schema=schema, feature_dims=feature_dims)
    width = representation_width(config, schema) if dd.representation > 0 else 0
    return TransferStudent(build, schema, feature_dims, width, dd.representation, dd.adapter)


def missing_columns_message(path, missing: list[str]) -> str:
    return (
        f"trainer.distill.source=data: {path} has no column(s) {missing}; write the teacher's "
        f"outputs with `python -m gem.transfer.export ... transfer.checkpoint=<teacher step_N> "
        f"transfer.out=<dir>{' transfer.representation=heads|history' if REPR_COLUMN in missing else ''}` and "
        "train on data.dir=<dir>, or use trainer.distill.source=model"
    )


def check_teacher_columns(config, schema: FeatureSchema, files_of: Callable[[str], list]) -> None:
    """``source=data``: every file of the splits the run reads has the teacher columns it needs."""
    import pyarrow.parquet as pq

    dd = config.trainer.distill
    columns = [f"teacher_{k}" for k in needed_tasks(config, schema)]
    columns += [REPR_COLUMN] if dd.representation > 0 else []
    # distillation alone only needs them to train; the student's inputs also in evaluation
    splits = ("train", "val", "test") if (dd.representation > 0 or dd.adapter) else ("train",)
    for split in splits:
        try:
            files = files_of(split)
        except DataError:  # a missing evaluation split: the trainer says so itself
            continue
        for path in files:
            names = pq.read_schema(path).names
            missing = [c for c in columns if c not in names]
            if missing:
                raise DataError(missing_columns_message(path, missing))


def attach_teacher(config, schema: FeatureSchema, model: nn.Module, device: torch.device):
    """``source=model``: load the teacher and fill ``batch.teacher`` ``[B, K]`` (NaN for a task it
    is not asked for) and, with ``representation``, ``batch.teacher_repr`` before every forward of
    ``model`` (a forward pre-hook: training and evaluation alike). Returns the teacher and the
    hook's handle. The teacher is held by the hook only: not a submodule, so neither in the
    model's parameters (the optimizers) nor in its checkpoints."""
    from gem.train.config import kernel_settings_of
    from gem.transfer.teacher import load_teacher
    from kernels.jagged_attention import settings as kernel_settings

    dd = config.trainer.distill
    tasks = needed_tasks(config, schema)
    # the run's kernel settings, as the student's attention modules have them (gem.train.setup.build_model)
    settings = kernel_settings.resolve(**kernel_settings_of(config))
    teacher = load_teacher(dd.checkpoint, schema, tuple(tasks), device, kernel_settings=settings)
    index = torch.tensor([schema.tasks.index(k) for k in tasks], device=device, dtype=torch.long)
    keep_repr = dd.representation > 0
    if keep_repr and not capabilities(teacher.model.dense_arch).head_representation:
        raise CheckpointError(
            f"trainer.distill.representation: the teacher {dd.checkpoint} has no `heads` module whose input "
            "is its representation"
        )

    def fill(module, args):  # the online teacher's outputs replace any teacher columns of the data
        (batch,) = args
        logits, rep = teacher(batch)
        teacher.check(logits)
        out = torch.full((batch.batch_size, len(schema.tasks)), float("nan"), device=logits.device)
        batch.teacher = out.index_copy_(1, index, logits)
        if keep_repr:
            teacher.check(rep, "representation")
            batch.teacher_repr = rep

    return teacher, model.register_forward_pre_hook(fill)


def prepare_teacher(config, schema: FeatureSchema, model: nn.Module, device: torch.device, files_of) -> None:
    """Before training: the teacher's outputs are there (``source=data``) or will be (``source=model``)."""
    if not uses_teacher(config):
        return
    if config.trainer.distill.source == "data":
        check_teacher_columns(config, schema, files_of)
    else:
        attach_teacher(config, schema, model, device)
