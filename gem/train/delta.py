"""Delta export: publish each trained increment without shipping the whole model.

A run with ``trainer.delta_export.every`` set writes, after every ``N`` steps (or after every
streamed partition), a folder ``<run_dir>/deltas/<seq>/`` (``seq`` = 000000, 000001, ...) that a
serving system applies to the model it already holds:

==================  ==========================================================================
file                what
==================  ==========================================================================
``sparse.pt``       per table: ``ids [N]`` (int64, the rows touched since the previous delta)
                    and ``rows [N, D]`` (their values now), keyed as in the checkpoint
                    (``ebc.embedding_bags.<table>.weight``)
``id_mapping.pt``   every non-table entry of the SparseArch (``sparse.ids``' mapping state: raw
                    id -> row), whole, since admissions and evictions rewrite it anywhere
``dense.pt``        the dense arch's state dict, whole
``optim.pt``        (``optimizer_state: true``) the touched rows' Adagrad momentum per table and
                    the dense AdamW state
``manifest.json``   seq, the previous seq, ``lineage`` (the run's lineage id, as its checkpoints
                    carry it), ``base_step`` (the step of the state it patches), ``step``,
                    ``partition``, the tables (key, rows, shape), each file's size and CRC-32
==================  ==========================================================================

A row is "touched" when a training batch looked it up: the tracker hooks the SparseArch and reads
the rows after ``sparse.ids`` mapped the raw ids, so it works for the native and the TorchRec
backends, sharded or not. Rows that no training batch looked up get no gradient, and neither
row-wise Adagrad nor Adagrad moves them, so ``base + the chain`` equals the trained tables
bit for bit (tests/test_delta.py compares with the run's final checkpoint).

The chain starts at a checkpoint (the base): a fresh run saves one at its first step. A delta
with ``base_step <= B < step`` applies to a checkpoint of step ``B`` (a row touched after ``B``
was touched after ``base_step``), so any later checkpoint is a base too. After a restart from a
checkpoint of step ``S``, deltas written after ``S`` are dropped (training repeats those steps
exactly and writes them again); when the newest remaining delta is older than ``S``, the rows
touched in between are unknown and the next delta carries every row (``full: true``).

One process only (native or TorchRec tables, sharded or not): on several ranks a table's rows
and the touched ids are spread over the ranks, which this exporter does not gather yet.

``python -m gem.train.delta apply --base <step_N folder> --deltas <run>/deltas --out <folder>``
applies a chain (see :func:`apply_chain`). It refuses, in one line naming both sides, a base of
another lineage (another run's checkpoint), a base whose tables' shapes differ from a delta's, and a
base whose step the chain does not reach; a delta or a base without a lineage id (written before
gem recorded one) is checked by the shapes alone, with a warning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gem.train.logging import logger

FORMAT = "gem-delta/1"
MANIFEST = "manifest.json"


class DeltaChainError(ValueError):
    """A delta chain that cannot be applied (a gap, deltas out of order, a wrong base, a damaged
    file); the message names the seq, the folder and the fix."""


# ------------------------------------------------------------------------------------ tracking


class TouchedRows:
    """Which rows of each table training batches looked up, as one bool mask ``[rows]`` per table.

    Installed as a hook on the SparseArch: on the mapped ids when ``sparse.ids`` maps raw ids
    (the IdMapper's output), on the SparseArch's inputs otherwise. Evaluation forwards (the module
    in eval mode) do not count: they change no row.
    """

    def __init__(self, arch: nn.Module) -> None:
        self.table_of = {f: t.name for t in arch.tables for f in t.feature_names}
        self.num_rows = {t.name: t.num_embeddings for t in arch.tables}
        self.masks: dict[str, torch.Tensor] = {}  # made on the first batch's device, where the ids are
        self.batches = 0  # training forwards seen since the last reset
        if arch.ids is not None:
            self._handle = arch.ids.register_forward_hook(self._after_mapping)
        else:
            self._handle = arch.register_forward_pre_hook(self._before_lookup)

    def _before_lookup(self, module, args) -> None:
        if module.training:
            self.record(args[0], args[1])

    def _after_mapping(self, module, args, output) -> None:
        if module.training:
            self.record(*output)

    def record(self, *kjts) -> None:
        """Mark the rows of every key of ``kjts`` (KeyedJaggedTensors of row ids)."""
        self.batches += 1
        for kjt in kjts:
            if not kjt.keys():
                continue
            for key, values in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
                table = self.table_of[key]
                if table not in self.masks:
                    self.masks[table] = torch.zeros(self.num_rows[table], dtype=torch.bool, device=values.device)
                self.masks[table][values] = True

    def touched(self, table: str) -> torch.Tensor:
        """The touched rows of ``table``, ascending, int64 on the CPU."""
        mask = self.masks.get(table)
        return mask.nonzero().view(-1).cpu() if mask is not None else torch.zeros(0, dtype=torch.int64)

    def reset(self) -> None:
        for mask in self.masks.values():
            mask.zero_()
        self.batches = 0

    def close(self) -> None:
        self._handle.remove()


# -------------------------------------------------------------------------------------- export


@dataclass
class _Link:
    """The end of the chain: the newest committed delta, or the base when there is none."""

    seq: int  # the next delta's seq
    previous: int | None
    base_step: int
    full: bool  # the rows touched since base_step are unknown: the next delta carries every row


class DeltaExporter:
    """Writes the chain of deltas of one training run (see the module docstring).

    Args:
        directory: ``<run_dir>/deltas`` (or ``trainer.delta_export.dir``).
        model: the GEMModel, one process.
        dense_opt / sparse_opt: as from ``gem.train.optim.build_optimizers``.
        every: ``"partition"`` (the caller exports after each partition) or a number of steps.
        optimizer_state: also write the touched rows' momentum and the dense optimizer's state.
        step: the step training starts (or resumes) at.
    """

    def __init__(
        self, directory: Path, model: nn.Module, dense_opt, sparse_opt, every: str, optimizer_state: bool, step: int
    ) -> None:
        from gem.train.checkpoint import sparse_module

        self.dir = Path(directory)
        self.model, self.dense_opt, self.sparse_opt = model, dense_opt, sparse_opt
        self.every_steps = 0 if every == "partition" else int(every)
        self.optimizer_state = optimizer_state
        self.arch = sparse_module(model)
        self.tracker = TouchedRows(self.arch)
        self.link = self._resume(step)
        self.last_step = step
        self.lineage: str | None = None  # the run's lineage id, the checkpointer's (see start)

    def _resume(self, step: int) -> _Link:
        """Drop deltas newer than ``step`` (a restart repeats those steps) and find the chain's end."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        chain = read_chain(self.dir)
        kept = [m for m in chain if m["step"] <= step]
        for m in chain[len(kept) :]:
            logger.info(
                "delta export: dropping delta %06d (step %d, after the resumed step %d); it is written again",
                m["seq"],
                m["step"],
                step,
            )
            shutil.rmtree(self.dir / f"{m['seq']:06d}")
        if not kept:
            return _Link(0, None, step, False)
        last = kept[-1]
        if last["step"] < step:
            logger.warning(
                "delta export: the newest delta %06d is of step %d but training resumes at step %d; the rows "
                "touched in between are unknown, so delta %06d carries every row (align "
                "trainer.delta_export.every with checkpoint.every_steps to avoid it)",
                last["seq"],
                last["step"],
                step,
                last["seq"] + 1,
            )
        return _Link(last["seq"] + 1, last["seq"], last["step"], last["step"] < step)

    def start(self, ckpt, progress) -> None:
        """A chain without deltas starts at a checkpoint of the current step: save one if there is none.
        The deltas carry the run's lineage id, ``ckpt``'s (made fresh or taken from the checkpoint resumed)."""
        from gem.train.checkpoint import list_checkpoints

        self.lineage = ckpt.lineage
        if self.link.previous is None and not any(
            p.name == f"step_{progress.step:09d}" for p in list_checkpoints(ckpt.dir)
        ):
            ckpt.save(progress)
            logger.info("delta export: the chain's base is the checkpoint of step %d", progress.step)

    def maybe_export(self, step: int, total_steps: int, partition_done: str | None = None) -> None:
        """Export every ``every_steps`` steps, after the last step (the chain reaches the end) and, for a
        stream, after the step that finished partition ``partition_done`` (with either setting of ``every``)."""
        if partition_done or step == total_steps or (self.every_steps and step % self.every_steps == 0):
            self.export(step, partition_done)

    def export(self, step: int, partition: str | None = None) -> Path | None:
        """Write the delta of the steps since the previous one; None when no step was trained since."""
        if step == self.last_step and not self.link.full:
            return None
        if self.tracker.batches == 0 and step > self.last_step:
            raise RuntimeError(
                f"delta export: {step - self.last_step} steps trained but the row tracker saw no batch "
                "(a training pipeline that bypasses the SparseArch's forward?); set sparse.pipeline=false"
            )
        from gem.train.checkpoint import _crc32

        tick = time.perf_counter()
        seq = self.link.seq
        final, tmp = self.dir / f"{seq:06d}", self.dir / f".tmp-{seq:06d}"
        tmp.mkdir(parents=True)
        tables = self._write_state(tmp)
        manifest = {
            "format": FORMAT,
            "seq": seq,
            "previous": self.link.previous,
            "lineage": self.lineage,
            "base_step": self.link.base_step,
            "step": step,
            "partition": partition,
            "full": self.link.full,
            "optimizer_state": self.optimizer_state,
            "tables": tables,
            "time": time.time(),
            "files": {p.name: {"size": p.stat().st_size, "crc32": _crc32(p)} for p in sorted(tmp.iterdir())},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, final)
        rows = sum(t["rows"] for t in tables.values())
        logger.info(
            "delta %06d: steps %d..%d%s, %d rows of %d tables, to %s in %.2fs",
            seq,
            self.link.base_step + 1,
            step,
            f" (partition {partition})" if partition else "",
            rows,
            len(tables),
            final,
            time.perf_counter() - tick,
        )
        self.link = _Link(seq + 1, seq, step, False)
        self.last_step = step
        self.tracker.reset()
        return final

    def _write_state(self, folder: Path) -> dict[str, dict]:
        sparse_state = self.arch.state_dict()
        keys = {t.name: _table_key(t) for t in self.arch.tables}
        rows, tables = {}, {}
        for spec in self.arch.tables:
            ids = torch.arange(spec.num_embeddings) if self.link.full else self.tracker.touched(spec.name)
            weight = _whole(sparse_state[keys[spec.name]])
            rows[keys[spec.name]] = {"ids": ids, "rows": weight.index_select(0, ids.to(weight.device)).cpu()}
            tables[spec.name] = {
                "key": keys[spec.name],
                "rows": int(ids.numel()),
                "num_embeddings": spec.num_embeddings,
                "dim": spec.embedding_dim,
            }
        torch.save(rows, folder / "sparse.pt")
        other = {k: _cpu(v) for k, v in sparse_state.items() if k not in keys.values()}
        torch.save(other, folder / "id_mapping.pt")
        torch.save({k: _cpu(v) for k, v in self.model.dense_arch.state_dict().items()}, folder / "dense.pt")
        if self.optimizer_state:
            torch.save(self._optimizer_state(rows), folder / "optim.pt")
        return tables

    def _optimizer_state(self, rows: dict[str, dict]) -> dict[str, Any]:
        """``optim.sparse.<key>``: the touched rows' momentum ``[N, *]``; ``optim.dense.<key>``: AdamW, whole."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from gem.train.checkpoint import flat_optim_options, sparse_optim_state  # the checkpoint's keys, exactly

        out = {}
        momentum, _ = sparse_optim_state(self.model, self.sparse_opt)
        for name, value in momentum.items():
            key = _table_key_of(name, rows)
            ids = rows[key]["ids"]
            table = _whole(value).view(self.tracker.num_rows[key.split(".")[-2]], -1)
            out[f"optim.sparse.{name}"] = {"ids": ids, "rows": table.index_select(0, ids.to(table.device)).cpu()}
        dense = get_optimizer_state_dict(self.model.dense_arch, self.dense_opt, options=flat_optim_options())
        out |= {f"optim.dense.{k}": _cpu(v) for k, v in dense.items()}
        return out

    def close(self) -> None:
        self.tracker.close()


def build_exporter(
    config, model: nn.Module, dense_opt, sparse_opt, run_dir: Path, world_size: int, step: int, partitions: bool = False
) -> DeltaExporter | None:
    """The run's exporter for ``trainer.delta_export`` (None when it is off); ``partitions``: the data
    source streams partitions (``every: partition`` needs one)."""
    from gem.train.config import ConfigError

    de = config.trainer.delta_export
    if not de.every:
        return None
    if de.every == "partition" and not partitions:
        raise ConfigError(
            "trainer.delta_export.every=partition needs a streamed data source (data.kind=stream); "
            "set trainer.delta_export.every=<N steps>"
        )
    if world_size > 1:
        raise ConfigError(
            f"trainer.delta_export runs in one process for now ({world_size} ranks here): a table's "
            "rows are spread over the ranks; set trainer.delta_export.every=null or train on one rank"
        )
    if not config.checkpoint.enabled:
        raise ConfigError(
            "trainer.delta_export needs checkpoint.enabled=true: a delta chain starts at a checkpoint "
            "(its base) and resumes with the run"
        )
    return DeltaExporter(
        Path(de.dir or run_dir / "deltas"), model, dense_opt, sparse_opt, de.every, de.optimizer_state, step
    )


def _table_key(spec) -> str:
    """The table's weight key in the SparseArch's state dict (the same for both backends)."""
    return f"{'ebc.embedding_bags' if spec.pooled else 'ec.embeddings'}.{spec.name}.weight"


def _table_key_of(momentum_name: str, rows: dict[str, dict]) -> str:
    """The weight key of the table whose momentum is ``<...><table key>.momentum1``."""
    stem = momentum_name.rsplit(".", 1)[0]
    for key in rows:
        if stem == key or stem.endswith("." + key):
            return key
    raise KeyError(f"delta export: optimizer state {momentum_name!r} belongs to no table of {sorted(rows)}")


def _whole(t):
    """A plain tensor of ``t``'s global value: a ShardedTensor or DTensor of one process holds all of it."""
    if hasattr(t, "local_shards"):  # ShardedTensor
        out = torch.empty(t.size(), dtype=t.dtype)
        for shard in t.local_shards():
            index = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
            out[index] = shard.tensor.detach().cpu()
        return out
    if hasattr(t, "full_tensor"):  # DTensor
        return t.full_tensor().detach()
    return t.detach() if isinstance(t, torch.Tensor) else t


def _cpu(value):
    """A host copy of a tensor entry (another value as it is)."""
    value = _whole(value)
    return value.cpu().clone() if isinstance(value, torch.Tensor) else value


# --------------------------------------------------------------------------------------- apply

# The manifest keys that apply reads, and their types (``lineage`` is absent from older deltas).
_MANIFEST_KEYS = {
    "format": str,
    "seq": int,
    "previous": (int, type(None)),
    "base_step": int,
    "step": int,
    "tables": dict,
    "files": dict,
}
_TABLE_KEYS = {"key": str, "rows": int, "num_embeddings": int, "dim": int}
_FILE_KEYS = {"size": int, "crc32": int}


def read_manifest(folder: Path) -> dict:
    """The manifest of the delta in ``folder``; a missing or damaged one (not JSON, a key missing or
    of the wrong type) raises a :class:`DeltaChainError` naming the file and what is wrong."""
    folder = Path(folder)
    file = folder / MANIFEST
    if not file.is_file():
        raise DeltaChainError(
            f"delta {folder}: no {MANIFEST}, so it is not a complete delta; remove the folder "
            "(the run writes it again on resume)"
        )
    try:
        m = json.loads(file.read_text())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        problem = f"it is not valid JSON ({e})"
    else:
        other_format = isinstance(m, dict) and m.get("format", FORMAT) != FORMAT
        problem = None if other_format else _manifest_problem(m)
    if problem:
        raise DeltaChainError(
            f"delta manifest {file} is damaged: {problem}; copy the delta again from the training run"
        )
    if m["format"] != FORMAT or m.get("seq") != int(folder.name):
        raise DeltaChainError(f"delta {folder}: {MANIFEST} is not a {FORMAT} manifest of seq {int(folder.name)}")
    return m


def _manifest_problem(m: Any) -> str | None:
    """What is wrong with a parsed manifest, or None."""
    if not isinstance(m, dict):
        return f"it holds a JSON {type(m).__name__}, not an object"
    problem = _entries_problem(m, _MANIFEST_KEYS, "")
    if problem:
        return problem
    for section, keys in (("tables", _TABLE_KEYS), ("files", _FILE_KEYS)):
        for name, entry in m[section].items():
            if not isinstance(entry, dict):
                return f"{section}.{name} is not an object"
            if problem := _entries_problem(entry, keys, f"{section}.{name}."):
                return problem
    return None


def _entries_problem(entries: dict, keys: dict[str, Any], where: str) -> str | None:
    missing = [k for k in keys if k not in entries]
    if missing:
        return f"no key {', '.join(where + k for k in missing)}"
    for key, kind in keys.items():
        value = entries[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            names = " or ".join("null" if t is type(None) else t.__name__ for t in kinds)
            return f"{where}{key} is {json.dumps(value)[:40]}, not {names}"
    return None


def read_chain(directory: Path) -> list[dict]:
    """The committed deltas' manifests in ``directory``, by seq, checked to form one chain: seqs
    consecutive, each naming its predecessor, patching the step its predecessor ended at and of the
    same lineage (where both record one)."""
    directory = Path(directory)
    folders = sorted(p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) if directory.is_dir() else []
    manifests = [read_manifest(folder) for folder in folders]
    for prev, m in zip(manifests, manifests[1:]):
        if m["seq"] != prev["seq"] + 1:
            missing = ", ".join(f"{s:06d}" for s in range(prev["seq"] + 1, m["seq"]))
            raise DeltaChainError(
                f"delta chain in {directory} has a gap: seq {missing} missing between "
                f"{prev['seq']:06d} (step {prev['step']}) and {m['seq']:06d} (step {m['step']}); "
                "copy the missing deltas there, or start from a checkpoint of a later step"
            )
        if prev.get("lineage") and m.get("lineage") and prev["lineage"] != m["lineage"]:
            raise DeltaChainError(
                f"delta {m['seq']:06d} in {directory} follows lineage {m['lineage']}@step {m['base_step']}, but "
                f"delta {prev['seq']:06d} before it is of lineage {prev['lineage']}: the folder mixes deltas "
                "of different runs; keep one run's deltas in it"
            )
        if m["previous"] != prev["seq"] or m["base_step"] != prev["step"] or m["step"] <= prev["step"]:
            raise DeltaChainError(
                f"delta {m['seq']:06d} in {directory} is out of order: it patches seq {m['previous']} "
                f"at step {m['base_step']} (ends at step {m['step']}), but seq {prev['seq']:06d} "
                f"ends at step {prev['step']}; the folder mixes deltas of different runs"
            )
    return manifests


def load_checkpoint_state(path: Path) -> tuple[dict[str, Any], int]:
    """A gem checkpoint folder ``step_<N>`` as one flat dict of plain tensors, and its step; the
    run's lineage id is ``state["lineage"]`` (None for a checkpoint written before gem recorded one)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gem.train.checkpoint import MANIFEST as CHECKPOINT_MANIFEST

    manifest = Path(path) / CHECKPOINT_MANIFEST
    if not manifest.is_file():
        raise DeltaChainError(
            f"--base {path}: no {CHECKPOINT_MANIFEST}, so it is not a complete gem checkpoint; "
            "give a step_<N> folder of the run's checkpoints/"
        )
    try:
        meta = json.loads(manifest.read_text())
    except ValueError as e:
        raise DeltaChainError(f"--base {path}: {manifest} is damaged: it is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise DeltaChainError(f"--base {path}: {manifest} is damaged: it records no step")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    state["lineage"] = state.get("lineage") or meta.get("lineage")
    return state, meta["step"]


def apply_chain(
    state: dict[str, Any], base_step: int, directory: Path, base: Path | str | None = None
) -> tuple[dict[str, Any], list[int]]:
    """Apply the deltas of ``directory`` that end after ``base_step`` to a checkpoint's flat ``state``
    (``model.sparse.*``, ``model.dense.*``, ``optim.*``; ``lineage``: its run's id), in place;
    returns it and the seqs applied. ``base``: the checkpoint's folder, named in the messages.

    Refused before anything is applied, with one line naming both sides: deltas of another lineage
    than the base's, a first delta that patches a step later than ``base_step``, a table whose
    shape differs from the base's. Where the base or a delta has no lineage id (written before gem
    recorded one), the shapes alone tell, with a warning. Each file's CRC-32 is checked before
    anything of that delta is applied."""
    directory = Path(directory)
    lineage = state.get("lineage")
    name = f"base checkpoint {base}" if base is not None else "the base checkpoint"
    here = f"{name} is lineage {lineage or '<unknown>'}@step {base_step}"
    whole = read_chain(directory)
    chain = [m for m in whole if m["step"] > base_step]

    def folder(m: dict) -> Path:
        return directory / f"{m['seq']:06d}"

    def follows(m: dict) -> str:
        return f"delta {folder(m)} follows lineage {m.get('lineage') or '<unknown>'}@step {m['base_step']}"

    other = next((m for m in chain or whole if lineage and m.get("lineage") not in (None, lineage)), None)
    if other is not None:
        raise DeltaChainError(f"{follows(other)}, {here}: apply it to a checkpoint of the same run")
    if not chain:
        raise DeltaChainError(f"no delta in {directory} ends after the base's step {base_step} ({here})")
    first = chain[0]
    if first["base_step"] > base_step:
        raise DeltaChainError(
            f"delta {first['seq']:06d} patches the state of step {first['base_step']}, later than the base's "
            f"step {base_step}: the deltas of steps {base_step + 1}..{first['base_step']} are missing from "
            f"{directory} ({follows(first)}, {here}); use a checkpoint of step >= {first['base_step']} as --base"
        )
    unknown = next((m for m in chain if not m.get("lineage")), None)
    if not lineage or unknown is not None:
        logger.warning(
            "%s has no lineage id (written before gem recorded one), so whether the base and the deltas are of "
            "one run is not known; checking only that their tables' shapes agree",
            name if not lineage else f"delta {folder(unknown)}",
        )
    for m in chain:
        for table, spec in m["tables"].items():
            key, want = f"model.sparse.{spec['key']}", [spec["num_embeddings"], spec["dim"]]
            have = list(state[key].shape) if isinstance(state.get(key), torch.Tensor) else None
            if have != want:
                raise DeltaChainError(
                    f"{follows(m)} and has table {table} of shape {want}, {here} and has "
                    f"{have if have is not None else f'no {key}'}: the base and the deltas are of different "
                    "models; apply them to a checkpoint of the run that wrote them"
                )
    for m in chain:
        _apply_one(state, folder(m), m)
    return state, [m["seq"] for m in chain]


def _apply_one(state: dict[str, Any], folder: Path, manifest: dict) -> None:
    from gem.train.checkpoint import _crc32

    for name, want in manifest["files"].items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != want["size"] or _crc32(file) != want["crc32"]:
            raise DeltaChainError(
                f"delta {folder}: file {name} is missing, truncated or corrupted (size / CRC-32 "
                "differ from its manifest); copy it again from the training run"
            )
    load = lambda name: torch.load(folder / name, weights_only=True)  # noqa: E731
    for key, part in load("sparse.pt").items():
        _set_rows(state, f"model.sparse.{key}", part, folder)
    for prefix, name in (("model.sparse.", "id_mapping.pt"), ("model.dense.", "dense.pt")):
        for key, value in load(name).items():
            _set(state, prefix + key, value, folder)
    if "optim.pt" in manifest["files"]:
        for key, value in load("optim.pt").items():
            if isinstance(value, dict):  # a table's touched momentum rows
                _set_rows(state, key, value, folder)
            else:
                _set(state, key, value, folder)


def _set(state: dict[str, Any], key: str, value: Any, folder: Path) -> None:
    if key not in state:
        raise DeltaChainError(
            f"delta {folder}: {key} is not in the base checkpoint; the base and the deltas are of different models"
        )
    old = state[key]
    if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape != value.shape:
        raise DeltaChainError(
            f"delta {folder}: {key} is of shape {list(value.shape)} there and {list(old.shape)} in the base "
            "checkpoint; the base and the deltas are of different models"
        )
    state[key] = value


def _set_rows(state: dict[str, Any], key: str, part: dict, folder: Path) -> None:
    if key not in state:
        raise DeltaChainError(
            f"delta {folder}: {key} is not in the base checkpoint; the base and the deltas are of different models"
        )
    target, rows, ids = state[key], part["rows"], part["ids"]
    # target: an [R, D] table, or momentum [R] / [R * D] whose rows came as [N, 1] / [N, D]
    width = math.prod(rows.shape[1:])
    fits = target.numel() % max(1, width) == 0 and (target.dim() != 2 or target.shape[1:] == rows.shape[1:])
    view = target.view(-1, *rows.shape[1:]) if fits else None
    if view is None or (ids.numel() and int(ids.max()) >= view.shape[0]):
        raise DeltaChainError(
            f"delta {folder}: rows {list(rows.shape)} of {key} (ids up to {int(ids.max()) if ids.numel() else '-'}) "
            f"do not fit its shape {list(target.shape)} in the base checkpoint; the base and the deltas are of "
            "different models"
        )
    view.index_copy_(0, ids, rows.to(target.dtype))


def save_state(state: dict[str, Any], out: Path, base: Path, base_step: int, applied: list[int], step: int) -> None:
    """``state``'s tensors as a DCP folder (``dcp_to_torch_save`` reads it) plus ``applied.json``."""
    import torch.distributed.checkpoint as dcp

    out = Path(out)
    if out.exists():
        raise DeltaChainError(f"--out {out} exists; give a new folder")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k.startswith(("model.", "optim."))}
    dcp.save(tensors, checkpoint_id=str(out), no_dist=True)
    record = {
        "base": str(base),
        "lineage": state.get("lineage"),
        "base_step": base_step,
        "deltas": applied,
        "step": step,
    }
    (out / "applied.json").write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem.train.delta", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply", help="apply a chain of deltas to a base checkpoint")
    apply.add_argument("--base", type=Path, required=True, help="a checkpoint folder step_<N>")
    apply.add_argument("--deltas", type=Path, required=True, help="the run's deltas/ folder")
    apply.add_argument("--out", type=Path, required=True, help="a new folder for the resulting state (DCP)")
    args = parser.parse_args(argv)
    try:
        state, base_step = load_checkpoint_state(args.base)
        state, applied = apply_chain(state, base_step, args.deltas, base=args.base)
        step = next(m["step"] for m in read_chain(args.deltas) if m["seq"] == applied[-1])
        save_state(state, args.out, args.base, base_step, applied, step)
    except DeltaChainError as e:
        print(f"Error in the delta chain: {e}", file=sys.stderr)
        return 1
    print(
        f"applied deltas {applied[0]:06d}..{applied[-1]:06d} to {args.base} (step {base_step}): step {step} in "
        f"{args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
