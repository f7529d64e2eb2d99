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
``manifest.json``   seq, the previous seq, ``base_step`` (the step of the state it patches),
                    ``step``, ``partition``, the tables and row counts, each file's size and CRC-32
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
applies a chain (see :func:`apply_chain`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
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
        """A chain without deltas starts at a checkpoint of the current step: save one if there is none."""
        from gem.train.checkpoint import list_checkpoints

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
        tick = time.perf_counter()
        seq = self.link.seq
        final, tmp = self.dir / f"{seq:06d}", self.dir / f".tmp-{seq:06d}"
        tmp.mkdir(parents=True)
        tables = self._write_state(tmp)
        manifest = {
            "format": FORMAT,
            "seq": seq,
            "previous": self.link.previous,
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


def read_chain(directory: Path) -> list[dict]:
    """The committed deltas' manifests in ``directory``, by seq, checked to form one chain: seqs
    consecutive, each naming its predecessor and patching the step its predecessor ended at."""
    directory = Path(directory)
    manifests = []
    for folder in (
        sorted(p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) if directory.is_dir() else []
    ):
        file = folder / MANIFEST
        if not file.is_file():
            raise DeltaChainError(
                f"delta {folder}: no {MANIFEST}, so it is not a complete delta; remove the folder "
                "(the run writes it again on resume)"
            )
        m = json.loads(file.read_text())
        if m.get("format") != FORMAT or m.get("seq") != int(folder.name):
            raise DeltaChainError(f"delta {folder}: {MANIFEST} is not a {FORMAT} manifest of seq {int(folder.name)}")
        manifests.append(m)
    for prev, m in zip(manifests, manifests[1:]):
        if m["seq"] != prev["seq"] + 1:
            missing = ", ".join(f"{s:06d}" for s in range(prev["seq"] + 1, m["seq"]))
            raise DeltaChainError(
                f"delta chain in {directory} has a gap: seq {missing} missing between "
                f"{prev['seq']:06d} (step {prev['step']}) and {m['seq']:06d} (step {m['step']}); "
                "copy the missing deltas there, or start from a checkpoint of a later step"
            )
        if m["previous"] != prev["seq"] or m["base_step"] != prev["step"] or m["step"] <= prev["step"]:
            raise DeltaChainError(
                f"delta {m['seq']:06d} in {directory} is out of order: it patches seq {m['previous']} "
                f"at step {m['base_step']} (ends at step {m['step']}), but seq {prev['seq']:06d} "
                f"ends at step {prev['step']}; the folder mixes deltas of different runs"
            )
    return manifests


def load_checkpoint_state(path: Path) -> tuple[dict[str, Any], int]:
    """A gem checkpoint folder ``step_<N>`` as one flat dict of plain tensors, and its step."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gem.train.checkpoint import MANIFEST as CHECKPOINT_MANIFEST

    manifest = Path(path) / CHECKPOINT_MANIFEST
    if not manifest.is_file():
        raise DeltaChainError(
            f"--base {path}: no {CHECKPOINT_MANIFEST}, so it is not a complete gem checkpoint; "
            "give a step_<N> folder of the run's checkpoints/"
        )
    step = json.loads(manifest.read_text())["step"]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    return state, step


def apply_chain(state: dict[str, Any], base_step: int, directory: Path) -> tuple[dict[str, Any], list[int]]:
    """Apply the deltas of ``directory`` that end after ``base_step`` to a checkpoint's flat ``state``
    (``model.sparse.*``, ``model.dense.*``, ``optim.*``), in place; returns it and the seqs applied.

    The first delta applied must patch a step ``<= base_step``; each file's CRC-32 is checked
    before anything of that delta is applied."""
    chain = [m for m in read_chain(directory) if m["step"] > base_step]
    if not chain:
        raise DeltaChainError(f"no delta in {directory} ends after the base's step {base_step}")
    if chain[0]["base_step"] > base_step:
        raise DeltaChainError(
            f"delta {chain[0]['seq']:06d} patches the state of step {chain[0]['base_step']}, later "
            f"than the base's step {base_step}: the deltas of steps {base_step + 1}.."
            f"{chain[0]['base_step']} are missing from {directory}; use a checkpoint of step "
            f">= {chain[0]['base_step']} as --base"
        )
    for m in chain:
        _apply_one(state, Path(directory) / f"{m['seq']:06d}", m)
    return state, [m["seq"] for m in chain]


def _apply_one(state: dict[str, Any], folder: Path, manifest: dict) -> None:
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
    state[key] = value


def _set_rows(state: dict[str, Any], key: str, part: dict, folder: Path) -> None:
    if key not in state:
        raise DeltaChainError(
            f"delta {folder}: {key} is not in the base checkpoint; the base and the deltas are of different models"
        )
    target = state[key]  # [R, D] table, or momentum [R] / [R * D] whose rows came as [N, 1] / [N, D]
    target.view(-1, *part["rows"].shape[1:]).index_copy_(0, part["ids"], part["rows"].to(target.dtype))


def save_state(state: dict[str, Any], out: Path, base: Path, base_step: int, applied: list[int], step: int) -> None:
    """``state``'s tensors as a DCP folder (``dcp_to_torch_save`` reads it) plus ``applied.json``."""
    import torch.distributed.checkpoint as dcp

    out = Path(out)
    if out.exists():
        raise DeltaChainError(f"--out {out} exists; give a new folder")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k.startswith(("model.", "optim."))}
    dcp.save(tensors, checkpoint_id=str(out), no_dist=True)
    (out / "applied.json").write_text(
        json.dumps({"base": str(base), "base_step": base_step, "deltas": applied, "step": step}, indent=1)
    )


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


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
        state, applied = apply_chain(state, base_step, args.deltas)
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
