"""A trained model, rebuilt from its checkpoint, as a frozen teacher: per-task logits, the
representation its heads read (per candidate) and a history representation (per request, the
candidate left out) for a student's batches.

The teacher is rebuilt from the ``config.yaml`` its checkpoint carries (model, sparse tables,
schema), with plain (unsharded) tables on this process's device, every tensor loaded by DCP
(which reshards: a checkpoint written by N ranks with TorchRec-sharded tables loads here). It runs
under ``torch.no_grad()`` in eval mode, in bfloat16 autocast on CUDA. Each rank holds a whole
copy: meant for teachers whose tables fit one device (larger ones: export their outputs once,
``python -m gem.transfer.export``, and train on those).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from gem.data.pipeline.batch import Batch
from gem.data.pipeline.schema import FeatureSchema
from gem.models.capabilities import capabilities
from gem.sparse.arch import SparseOutput
from gem.train.checkpoint import CheckpointError
from gem.train.initialize import resolve_checkpoint


def checkpoint_config(path: Path):
    """The typed config of the run that wrote the checkpoint ``path`` (its ``config.yaml``)."""
    from gem.train.config import validate

    file = path / "config.yaml"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path}: no config.yaml, so the teacher's model cannot be rebuilt")
    return validate(OmegaConf.create(file.read_text()))


def teacher_schema(config, student: FeatureSchema, where: str) -> FeatureSchema:
    """The schema the teacher trained on: its config's ``data.schema``, else the ``gem.schema`` of its
    Parquet data set's files, else (those files gone) the student's, with a warning: then only the
    tensor shapes (:func:`check_shapes`) can tell a teacher of another schema."""
    from gem.data.errors import DataError
    from gem.data.format.dataset import schema_from_files, split_files
    from gem.train.logging import logger

    if config.data.schema:
        return FeatureSchema.from_config(config.data.schema)
    if config.data.kind == "parquet" and config.data.dir:
        try:
            return schema_from_files(split_files(config.data.dir, "train")[:1])
        except (DataError, OSError):
            pass
    logger.warning(
        "%s: the teacher's schema is neither in its config.yaml nor readable from its data (data.dir=%s); "
        "taking the student's, checked by tensor shapes only",
        where,
        config.data.dir,
    )
    return student


def check_shapes(state: dict, saved: dict, where: str) -> None:
    """Every tensor of the rebuilt teacher is in its checkpoint (``saved``: the manifest's
    ``{key: [shape, dtype]}``) with that shape, or the teacher was trained on another schema."""
    problems = [f"{k}: not in the checkpoint" for k in state if k not in saved]
    problems += [
        f"{k}: {saved[k][0]} in the checkpoint, {list(v.size())} for this data"
        for k, v in state.items()
        if k in saved and list(saved[k][0]) != list(v.size())
    ]
    if problems:
        raise CheckpointError(
            f"{where}: the teacher does not fit the model its config.yaml builds for this data's schema: "
            + "; ".join(problems[:6])
            + ("; ..." if len(problems) > 6 else "")
            + ". It was trained on another schema (feature cardinalities, num_dense, tasks); use a teacher "
            "trained on this data's features, or train the student on the teacher's"
        )


def _inputs(schema: FeatureSchema) -> dict:
    cfg = schema.to_config()
    return {k: v for k, v in cfg.items() if k != "tasks"}


def check_inputs(teacher: FeatureSchema, student: FeatureSchema, where: str) -> None:
    """The teacher reads the student's batches: the same id / sequence features, dense width and domains.
    A mismatch names each differing entry, the teacher's value against this data's."""
    from gem.data.format.checks import schema_differences

    a, b = _inputs(teacher), _inputs(student)
    if a != b:
        diff = [
            f"{what} {va} in the teacher's, {vb} in this data's"
            for what, va, vb in schema_differences(teacher, student)
            if what != "tasks are"
        ] or [  # the same entries, in another order
            f"{k} in the order {[x.get('name', x) for x in a[k]]} in the teacher's, "
            f"{[x.get('name', x) for x in b[k]]} in this data's"
            for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and isinstance(a.get(k), list)
        ]
        raise CheckpointError(
            f"{where}: the teacher was trained on another feature schema than the student's data "
            f"(tasks may differ, inputs may not): "
            + "; ".join(diff[:6])
            + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
            + "; use a teacher trained on this data's features, or train the student on the teacher's"
        )


DENSE = "dense"  # the name that leaves the dense features out of the history pass


def check_candidate_features(schema: FeatureSchema, names, key: str) -> tuple[str, ...]:
    """``names`` as the candidate-side inputs of :meth:`Teacher.history`: id features of ``schema``
    (the candidate ad's id, its cluster, its attributes ...) and ``dense`` (all dense features, when
    they describe the candidate); at least one. Raises naming ``key`` and the allowed names."""
    names = tuple(names)
    allowed = [*schema.id_feature_names, DENSE]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        history = [f for g in schema.sequence_groups for f in g.feature_names]
        raise ValueError(
            f"{key}={list(names)}: "
            + (f"unknown {unknown}; " if unknown else "empty; ")
            + f"name the candidate-side inputs the history pass leaves out, among the id features {allowed[:-1]} "
            f"and {DENSE!r} (every dense feature), e.g. {key}=[ad_id,ad_cluster] for the synthetic schema; the "
            f"sequence features {history} are the history, the domain the request's surface: both stay in"
        )
    return names


def _leave_out(names: tuple[str, ...]):
    """A forward hook on the sparse arch: the pooled embeddings of ``names`` replaced by zeros, what
    the sum-pooled tables give for an empty id list."""

    def hook(module, args, out: SparseOutput) -> SparseOutput:
        pooled = {f: torch.zeros_like(v) if f in names else v for f, v in out.pooled.items()}
        return SparseOutput(pooled, out.sequences)

    return hook


class Teacher(nn.Module):
    """``logits(batch) -> [B, len(tasks)]``: the teacher's logit of each of ``tasks`` (the student's
    task names; a task the teacher never learned is an error at construction).

    ``forward(batch)[1] -> [B, R]``: the input of the teacher's heads (the shared top MLP's
    output: one vector per example, user + history + candidate).

    ``history(batch, candidate_features) -> [B, H]``: the teacher's sequence summary tokens (its
    dense arch's ``final`` modules) from a pass with the candidate-side inputs left out: one vector
    per request, the same for every candidate of it."""

    def __init__(
        self, model: nn.Module, teacher_tasks: tuple[str, ...], tasks: tuple[str, ...], device: torch.device, where: str
    ) -> None:
        super().__init__()
        unknown = [t for t in tasks if t not in teacher_tasks]
        if unknown:
            raise CheckpointError(
                f"{where}: the teacher never learned task(s) {unknown}; it has {list(teacher_tasks)}; "
                f"distil only those (trainer.distill.tasks) or use a teacher trained on them"
            )
        self.tasks = tuple(tasks)
        self.where = where
        self.model = model.eval().requires_grad_(False)
        self.index = torch.tensor([teacher_tasks.index(t) for t in tasks], device=device)
        self.device = device
        self._repr: torch.Tensor | None = None
        if capabilities(model.dense_arch).head_representation:
            model.dense_arch.heads.register_forward_pre_hook(self._keep_repr)

    def _keep_repr(self, module, args) -> None:
        self._repr = args[0]

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train(self, mode: bool = True) -> Teacher:
        return super().train(False)  # always eval

    @torch.no_grad()
    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._repr = None
        with self._autocast():
            logits = self.model(batch)
        rep = self._repr.float() if self._repr is not None else None
        return logits.float().index_select(1, self.index), rep

    @torch.no_grad()
    def history(self, batch: Batch, candidate_features: tuple[str, ...]) -> torch.Tensor:
        """The history representation ``[B, H]``: every stream's sequence summary tokens, flattened and
        concatenated (``H = d * sum of the summaries' token counts``), from a forward in which the
        pooled embeddings of ``candidate_features`` are zeros (and the dense features, if ``dense``
        is named). Candidate-free: that pass reads only the user-side ids, the history, the domain
        (and the dense features), and every module of the arch is a function of its own example's
        rows (no batch statistics; eval mode), so rows of one request give the same vector.
        ``candidate_features``: checked by :func:`check_candidate_features`."""
        if not capabilities(self.model.dense_arch).sequence_summaries:
            raise CheckpointError(
                f"{self.where}: the teacher's dense arch {type(self.model.dense_arch).__name__} has no `final` "
                "sequence summaries (GEMDenseArch's), so it has no history representation; use the head input "
                "(transfer.representation=heads)"
            )
        final = self.model.dense_arch.final
        kept: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_hook(lambda _, a, out, n=n: kept.__setitem__(n, out)) for n, m in final.items()]
        hooks.append(self.model.sparse_arch.register_forward_hook(_leave_out(candidate_features)))
        if DENSE in candidate_features:
            batch = dataclasses.replace(batch, dense=torch.zeros_like(batch.dense))
        try:
            with self._autocast():
                self.model(batch)
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([kept[n].flatten(1) for n in final], dim=1).float()

    def logits(self, batch: Batch, check: bool = True) -> torch.Tensor:
        """The teacher's logits ``[B, len(tasks)]``; with ``check`` a NaN / inf one raises, naming the task
        (one device sync)."""
        out = self(batch)[0]
        if check:
            self.check(out)
        return out

    def check(self, values: torch.Tensor, what: str = "logits") -> None:
        """Raise if ``values`` (its logits ``[B, len(tasks)]``, or its ``representation`` ``[B, R]``)
        hold a NaN or inf, naming the tasks (one device sync)."""
        finite = torch.isfinite(values).all(0)
        if bool(finite.all()):
            return
        bad = [t for t, ok in zip(self.tasks, finite.tolist()) if not ok] if what == "logits" else "representation"
        raise FloatingPointError(
            f"{self.where}: the teacher's {bad} {what} are NaN or inf on this batch; its checkpoint is broken "
            "(trained into NaN?: use an earlier step_<N>) or the batch is outside what it can read"
        )


def load_teacher(
    path: str | Path,
    student: FeatureSchema,
    tasks: tuple[str, ...] | None,
    device: torch.device,
    key: str = "trainer.distill.checkpoint",
    kernel_settings=None,
) -> Teacher:
    """Rebuild and load the model of checkpoint ``path`` as a frozen :class:`Teacher` over the
    student's ``tasks`` (None: every task the teacher has). ``kernel_settings``: its attention
    kernels' settings (``gem.models.sequence.use_kernel_settings``; None: the process default)."""
    import torch.distributed.checkpoint as dcp
    from hydra.utils import instantiate
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from gem.models.gem import GEMModel
    from gem.models.sequence import use_kernel_settings
    from gem.sparse.arch import SparseArch

    path = resolve_checkpoint(path, key)
    config = checkpoint_config(path)
    schema = teacher_schema(config, student, f"{key}={path}")
    check_inputs(schema, student, f"{key}={path}")
    s = config.sparse
    sparse = SparseArch.from_config(schema, s.embedding_dim, s.init_scale, s.dims, s.backend, device=device)
    arch = sparse
    feature_dims = {f: arch.pooled_dim(f) for f in schema.id_feature_names}
    feature_dims.update({g.name: arch.sequence_dim(g.name) for g in schema.sequence_groups})
    model_cfg = OmegaConf.create(config.model)
    if "attention_backend" in model_cfg and device.type != "cuda":
        model_cfg.attention_backend = None
    dense = instantiate(model_cfg, _partial_=True, _convert_="all")(schema=schema, feature_dims=feature_dims)
    dense.to(device)
    use_kernel_settings(dense, kernel_settings)
    model = GEMModel(sparse, dense)
    state = {f"model.sparse.{k}": v for k, v in sparse.state_dict().items()}
    state |= {f"model.dense.{k}": v for k, v in dense.state_dict().items()}
    from gem.train.initialize import manifest_shapes

    check_shapes(state, manifest_shapes(path), f"{key}={path}")
    try:
        dcp.load(
            state,
            checkpoint_id=str(path),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        )
    except Exception as e:
        raise CheckpointError(
            f"{key}={path}: could not load the teacher ({type(e).__name__}: {str(e)[:500]})"
        ) from None
    sparse.load_state_dict(
        {k.removeprefix("model.sparse."): v for k, v in state.items() if k.startswith("model.sparse.")}
    )
    dense.load_state_dict({k.removeprefix("model.dense."): v for k, v in state.items() if k.startswith("model.dense.")})
    return Teacher(model, schema.tasks, tuple(tasks) if tasks is not None else schema.tasks, device, f"{key}={path}")
