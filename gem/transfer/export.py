"""Teacher outputs as data: run a trained checkpoint over a data set and write its logits as columns.

    python -m gem.transfer.export <hydra overrides of the data set> transfer.checkpoint=<step_N or checkpoints/> \\
        transfer.out=<dir> [transfer.splits=[train,val,test]] [transfer.batch_size=4096] \\
        [transfer.representation=heads | transfer.representation=history transfer.candidate_features=[ad_id,...]]

The Hydra overrides pick the data set exactly as for ``python -m gem.train`` (``data.dir=...``, or
the synthetic generator's knobs); the model comes from the checkpoint (its ``config.yaml``). Every
input file ``<split>/<name>.parquet`` gives one output file ``<out>/<split>/<name>.parquet``: a copy
with the float32 columns ``teacher_<task>`` (the teacher's logits, one per task it learned) and, on
request, ``teacher_repr: list<float32>``, rows in the same order:

- ``transfer.representation=heads``: the input of the teacher's heads, one vector per example
  (user, history and candidate: a student reading it needs the teacher for every candidate);
- ``transfer.representation=history``: the teacher's sequence summary tokens from a pass with the
  candidate-side inputs (``transfer.candidate_features``: id features, or ``dense``) left out,
  one vector per request, the same for all its candidates (:meth:`Teacher.history`).

The file's ``gem.teacher_repr`` metadata records which (kind, candidate features, width). Outputs
are written atomically, so the export is resumable: a file already in ``out`` is skipped. Ranks
split the files (file ``i`` to rank ``i % world_size``; under torchrun from ``RANK`` /
``WORLD_SIZE``, or ``transfer.rank`` / ``transfer.world_size``), no process group needed. Train a
student on the result with ``data.kind=parquet data.dir=<out>`` and ``trainer.distill.weight=...``
(docs/transfer.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gem.data.pipeline.schema import FeatureSchema

REPRESENTATIONS = ("none", "heads", "history")
META_KEY = b"gem.teacher_repr"  # the file metadata that says which representation teacher_repr holds


@dataclass
class ExportConfig:
    checkpoint: str | None = None
    out: str | None = None
    splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    batch_size: int = 4096
    representation: str = "none"  # none | heads | history (REPRESENTATIONS)
    candidate_features: list[str] = field(default_factory=list)  # history: the inputs left out
    device: str = "auto"
    rank: int | None = None
    world_size: int | None = None


def parse(argv: list[str]) -> tuple[ExportConfig, list[str]]:
    """Split ``transfer.*`` keys (this tool's) from the Hydra overrides (the data set's)."""
    from omegaconf import OmegaConf

    mine = [a for a in argv if a.startswith("transfer.")]
    rest = [a for a in argv if not a.startswith("transfer.")]
    base = OmegaConf.structured(ExportConfig)
    try:
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist([a.removeprefix("transfer.") for a in mine]))
    except Exception as e:
        raise SystemExit(
            f"gem.transfer.export: bad transfer.* override ({e}); keys: {list(ExportConfig.__dataclass_fields__)}"
        ) from None
    cfg = ExportConfig(**OmegaConf.to_container(cfg))
    for key in ("checkpoint", "out"):
        if not getattr(cfg, key):
            raise SystemExit(f"gem.transfer.export: transfer.{key}=... is required")
    check_representation(cfg)
    return cfg, rest


def check_representation(cfg: ExportConfig) -> None:
    """``transfer.representation`` is one of :data:`REPRESENTATIONS` (``false`` = none; ``true``, which
    meant heads before history existed, is refused: say which); ``transfer.candidate_features``
    only with history, where it is required."""
    if cfg.representation in ("False", "false"):  # OmegaConf turns a bool into its str
        cfg.representation = "none"
    if cfg.representation not in REPRESENTATIONS:
        raise SystemExit(
            f"gem.transfer.export: transfer.representation={cfg.representation} must be one of "
            f"{list(REPRESENTATIONS)}: heads (the input of the teacher's heads, per candidate; what `true` wrote "
            "before) or history (a user / history vector, per request: with transfer.candidate_features=[...])"
        )
    if cfg.representation == "history" and not cfg.candidate_features:
        raise SystemExit(
            "gem.transfer.export: transfer.representation=history needs transfer.candidate_features=[...], the "
            "id features of the candidate ad (e.g. [ad_id,ad_cluster] for the synthetic schema, "
            "[item_id,item_attr] for seqrec) that its pass leaves out"
        )
    if cfg.candidate_features and cfg.representation != "history":
        raise SystemExit(
            f"gem.transfer.export: transfer.candidate_features={list(cfg.candidate_features)} is read only with "
            f"transfer.representation=history (not {cfg.representation})"
        )


def export_file(
    teacher,
    src: Path,
    dst: Path,
    schema: FeatureSchema,
    tasks: tuple[str, ...],
    batch_size: int,
    representation: str,
    device: torch.device,
    candidate_features: tuple[str, ...] = (),
) -> int:
    """Score every row of ``src`` with ``teacher``; write the copy with teacher columns to ``dst``
    (``representation``: ``none``, ``heads`` or ``history`` with ``candidate_features``)."""
    from gem.data.format.checks import check_rows
    from gem.data.format.reader import table_to_batch

    table = pq.read_table(src)
    logits, reps = [], []
    for start in range(0, table.num_rows, batch_size):
        part = table.slice(start, batch_size)
        check_rows(part, schema, f"{src} (rows {start}..{start + part.num_rows - 1})")
        batch, _ = table_to_batch(part, schema)
        batch = batch.to(device)
        out, rep = teacher(batch)
        logits.append(out.cpu().numpy())
        if representation == "history":
            rep = teacher.history(batch, candidate_features)
        elif representation == "heads" and rep is None:
            raise ValueError(
                "transfer.representation=heads: the teacher's dense arch has no `heads` module whose input "
                "could be kept"
            )
        if representation != "none":
            reps.append(rep.cpu().numpy())
    logits = np.concatenate(logits) if logits else np.zeros((0, len(tasks)), np.float32)
    if not np.isfinite(logits).all():
        bad = np.argwhere(~np.isfinite(logits))[0]
        raise ValueError(
            f"{src}: the teacher's {tasks[bad[1]]} logit of row {bad[0]} is {logits[tuple(bad)]}; "
            "the checkpoint is broken (trained into NaN?)"
        )
    for k, task in enumerate(tasks):
        name = f"teacher_{task}"
        if name in table.column_names:
            table = table.drop_columns([name])
        table = table.append_column(pa.field(name, pa.float32()), pa.array(logits[:, k].astype(np.float32)))
    if representation != "none":
        if "teacher_repr" in table.column_names:
            table = table.drop_columns(["teacher_repr"])
        rep = np.concatenate(reps).astype(np.float32) if reps else np.zeros((0, 1), np.float32)
        if not np.isfinite(rep).all():
            raise ValueError(
                f"{src}: the teacher's {representation} representation of row {np.argwhere(~np.isfinite(rep))[0][0]} "
                "is NaN or inf; the checkpoint is broken (trained into NaN?)"
            )
        width = rep.shape[1]
        table = table.append_column(
            pa.field("teacher_repr", pa.list_(pa.float32())),
            pa.ListArray.from_arrays(np.arange(table.num_rows + 1, dtype=np.int32) * width, rep.reshape(-1)),
        )
        about = {"kind": representation, "candidate_features": list(candidate_features), "width": width}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: json.dumps(about).encode()})
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, row_group_size=8192)
    tmp.replace(dst)
    return table.num_rows


def run(cfg: ExportConfig, overrides: list[str]) -> dict:
    """Export as configured; returns ``{"written": [...], "skipped": [...], "rows": n}`` for this rank."""
    from gem.data.format.dataset import split_files
    from gem.train.api import compose
    from gem.train.config import validate
    from gem.train.logging import logger, setup_logging
    from gem.train.setup import DistEnv, load_data
    from gem.transfer.teacher import check_candidate_features, load_teacher

    setup_logging(None, 0)
    check_representation(cfg)
    rank = cfg.rank if cfg.rank is not None else int(os.environ.get("RANK", 0))
    world = cfg.world_size if cfg.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    config = validate(compose(overrides))
    schema, data_dir = load_data(config, DistEnv(rank, world, 0, device))
    teacher = load_teacher(cfg.checkpoint, schema, None, device, key="transfer.checkpoint")
    tasks = teacher.tasks  # every task the teacher learned
    leave_out = ()
    if cfg.representation == "history":
        leave_out = check_candidate_features(schema, cfg.candidate_features, "transfer.candidate_features")
    out, done = Path(cfg.out), {"written": [], "skipped": [], "rows": 0}
    tick = time.perf_counter()
    for split in cfg.splits:
        files = split_files(data_dir, split)
        for i, src in enumerate(files):
            if i % world != rank:
                continue
            dst = out / split / src.name
            if dst.exists():
                done["skipped"].append(str(dst))
                continue
            done["rows"] += export_file(
                teacher, src, dst, schema, tasks, cfg.batch_size, cfg.representation, device, leave_out
            )
            done["written"].append(str(dst))
            logger.info("transfer.export: %s -> %s", src, dst)
    logger.info(
        "transfer.export: rank %d/%d wrote %d files (%d rows), skipped %d already written, in %.1fs",
        rank,
        world,
        len(done["written"]),
        done["rows"],
        len(done["skipped"]),
        time.perf_counter() - tick,
    )
    return done


def main(argv: list[str] | None = None) -> int:
    from gem.train.checkpoint import CheckpointError
    from gem.train.config import ConfigError

    cfg, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        run(cfg, overrides)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
