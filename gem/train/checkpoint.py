"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, reshard, verify.

One checkpoint is one DCP folder ``<dir>/step_<step>`` holding everything a run needs:

==================  ==========================================================================
key                 what
==================  ==========================================================================
``model.sparse``    embedding tables, as TorchRec's sharded state dict (ShardedTensor) or
                    plain tensors (unsharded / native backends); keys relative to SparseArch
``model.dense``     the dense arch (DTensor shards under FSDP2, plain tensors otherwise)
``optim.sparse``    row-wise Adagrad momentum ``[rows]`` per table, whether the fused
                    in-backward optimizer or the plain ``RowWiseAdagrad`` steps the table
``optim.dense``     AdamW, through ``get_optimizer_state_dict`` (keys are parameter names)
``scheduler``       the LR schedule's position
``progress``        step, epoch, examples consumed in the epoch (all ranks), examples seen
``config``          the resolved config (YAML), also written as ``config.yaml``
``lineage``         the run's lineage id (see below), also in ``gem_checkpoint.json``
==================  ==========================================================================

The lineage id (32 hex digits) names one training run: made when a run starts fresh and taken
from the checkpoint a run resumes from (``resume`` or ``load_from``, at any world size), so every
checkpoint of a run, before and after restarts, carries the same one; the delta export records it
in each delta, and ``python -m gem.train.delta apply`` refuses a base of another lineage. A
checkpoint written before gem recorded lineages has none: it loads, and the run goes on under a new id.

Beside DCP's files, ``rng_rank<r>.pkl`` holds rank ``r``'s python / numpy / torch / cuda RNG
states (per-rank values, which DCP's de-duplicated, rank-agnostic keys are not made for).

Because every entry is keyed by name with its global shape, DCP reshards on load: a checkpoint
written by 2 ranks with one TorchRec plan loads into 1 rank with another.

Writes are atomic: DCP writes into ``<dir>/.tmp-step_<step>``; once every rank's data and
DCP's ``.metadata`` are on disk, rank 0 writes ``gem_checkpoint.json`` (the step, the world
size, the lineage id, a fingerprint of every state entry's shape, and each file's size and
CRC-32) and renames the folder to ``step_<step>``. A crash mid-save leaves only a ``.tmp-`` folder, which is
ignored and removed at the next start. A save checks the free space first (``shutil.disk_usage``)
and reports a full disk, then or during the write, as "no space left on device" with the path and
the bytes needed and free. With ``async_save`` the state is copied (see
:func:`_snapshot`) and written by a background thread while training continues; the rename happens
on the training thread once the write is done.
"""

from __future__ import annotations

import copy as copy_module
import errno
import json
import os
import pickle
import random
import re
import shutil
import time
import uuid
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner

from gem.train.config import CheckpointConfig
from gem.train.logging import logger

MANIFEST = "gem_checkpoint.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def flat_optim_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Keys "state.<param>.<name>" and "param_groups.<param>.<name>": independent of the order of
    # parameters in the optimizer, and no lists for DCP to flatten.
    return StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder, the problem and the fix."""


@dataclass
class Progress:
    """Where training stands: the loader position is (epoch, examples consumed in it by all ranks).

    The epoch's examples are read in a seeded order, batch ``i`` by rank ``i % world_size``, so
    the position means the same examples under any world size or batch size that divides it.
    """

    step: int = 0
    epoch: int = 0
    examples_in_epoch: int = 0
    examples: int = 0


@dataclass
class _Pending:
    future: Any
    tmp: Path
    final: Path
    manifest: dict
    needed: int = 0  # bytes this rank writes, estimated (for a full disk's message)


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Committed checkpoints in ``directory``, oldest first (``.tmp-`` folders are not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def sparse_module(model: nn.Module) -> nn.Module:
    """The SparseArch inside its wrapper (DistributedModelParallel or DDP)."""
    arch = model.sparse_arch
    return arch.module if hasattr(arch, "module") else arch


class Checkpointer:
    """Saves and restores a training run's state (see the module docstring).

    Args:
        cfg: the ``checkpoint`` config node.
        directory: where the ``step_<step>`` folders live.
        model: the GEMModel (sharded or not).
        dense_opt / sparse_opt / scheduler: as from ``gem.train.optim.build_optimizers``.
        config_yaml: the resolved config, stored with every checkpoint.
        rank / world_size: this process and the job size.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path,
        model: nn.Module,
        dense_opt: torch.optim.Optimizer,
        sparse_opt: torch.optim.Optimizer | None,
        scheduler,
        config_yaml: str,
        rank: int = 0,
        world_size: int = 1,
        loader=None,
    ) -> None:
        self.cfg = cfg
        self.dir = Path(directory)
        self.model, self.dense_opt, self.sparse_opt, self.scheduler = model, dense_opt, sparse_opt, scheduler
        self.config_yaml = config_yaml
        self.rank, self.world_size = rank, world_size
        self.loader = loader  # the training loader (state_dict / load_state_dict), its position saved per rank
        self._pending: _Pending | None = None
        self._last_step = -1
        self._pg = None
        # The run's lineage id, rank 0's on every rank; restore() replaces it with the checkpoint's.
        self.lineage: str = self._on_rank0(new_lineage)
        if dist.is_initialized() and cfg.async_save:
            # The background writer runs collectives while training runs its own: give it its own group.
            self._pg = dist.new_group(backend="gloo")
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)

    # ----------------------------------------------------------------------------------- state

    def _state(self, progress: Progress) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dense_optim = get_optimizer_state_dict(self.model.dense_arch, self.dense_opt, options=flat_optim_options())
        sparse_optim, self._fused_keys = sparse_optim_state(self.model, self.sparse_opt)
        return {
            "model": {"sparse": sparse_module(self.model).state_dict(), "dense": self.model.dense_arch.state_dict()},
            "optim": {"sparse": sparse_optim, "dense": dense_optim},
            "scheduler": self.scheduler.state_dict(),
            "progress": asdict(progress),
            "config": self.config_yaml,
            "lineage": self.lineage,
        }

    def _fingerprint(self, state: dict[str, Any]) -> dict[str, list]:
        """Global shape and dtype of every model and sparse-optimizer entry, over all ranks (a
        fused optimizer lists only the tables it holds): what a compatible checkpoint must
        match (the sharding plan and world size may differ)."""
        out = {}
        for section in ("model", "optim"):
            for part, entries in state[section].items():
                if section == "optim" and part == "dense":
                    continue  # AdamW's layout follows the model's; its state is created lazily
                for key, t in entries.items():
                    if isinstance(t, torch.Tensor):
                        out[f"{section}.{part}.{key}"] = [list(t.size()), str(t.dtype).removeprefix("torch.")]
        if dist.is_initialized() and self.world_size > 1:
            every = [None] * self.world_size
            dist.all_gather_object(every, out)
            out = {k: v for rank_out in every for k, v in rank_out.items()}
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------------------------ save

    def maybe_save(self, progress: Progress, total_steps: int) -> None:
        """Save if ``progress.step`` is a multiple of ``every_steps`` or (``at_end``) the last step."""
        self.poll()
        every = self.cfg.every_steps
        if (every > 0 and progress.step % every == 0) or (self.cfg.at_end and progress.step == total_steps):
            self.save(progress)

    def save(self, progress: Progress) -> None:
        self.wait()  # one save in flight at a time
        if progress.step == self._last_step:  # e.g. the end of a run that just saved periodically
            return
        previous, self._last_step = self._last_step, progress.step
        final = self.dir / f"step_{progress.step:09d}"
        tick = time.perf_counter()
        tmp = self.dir / f".tmp-{final.name}"
        state = self._state(progress)
        manifest = {
            "step": progress.step,
            "world_size": self.world_size,
            "lineage": self.lineage,
            "time": time.time(),
            "progress": asdict(progress),
            "fingerprint": self._fingerprint(state),
        }
        flat = flatten_state(state)[0]
        rng, loader_state = _rng_state(), json.dumps(self.loader.state_dict()) if self.loader is not None else None
        needed = _state_bytes(flat) + len(rng) + len(loader_state or "") + len(self.config_yaml) + (1 << 16)
        try:
            self._check_space(final, needed)
        except CheckpointError:
            self._last_step = previous
            raise
        pending = _Pending(None, tmp, final, manifest, needed)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            # Written before DCP's save, whose final collective then proves every rank's file is on disk.
            (tmp / f"rng_rank{self.rank}.pkl").write_bytes(rng)
            if loader_state is not None:
                (tmp / f"loader_rank{self.rank}.json").write_text(loader_state)
            if self.cfg.async_save:
                future = dcp.async_save(
                    _snapshot(flat), checkpoint_id=str(tmp), process_group=self._pg, async_stager=_AlreadyStaged()
                )
                self._pending = _Pending(future, tmp, final, manifest, needed)
                logger.info(
                    "checkpoint step %d: staged in %.2fs, writing in the background",
                    progress.step,
                    time.perf_counter() - tick,
                )
            else:
                dcp.save(flat, checkpoint_id=str(tmp))
                self._commit(pending)
                logger.info(
                    "checkpoint step %d: saved to %s in %.2fs", progress.step, final, time.perf_counter() - tick
                )
        except Exception as e:
            self._last_step = previous
            self._raise_if_disk_full(e, pending)
            raise

    def _check_space(self, final: Path, needed: int) -> None:
        """Refuse to start a save that cannot fit (``needed``: this rank's bytes, an estimate from
        the state's tensors); on every rank when any rank is short, so none waits in a collective."""
        free = shutil.disk_usage(_existing_ancestor(self.dir)).free
        report = [(self.rank, needed, free)]
        if dist.is_initialized() and self.world_size > 1:
            report = [None] * self.world_size
            dist.all_gather_object(report, (self.rank, needed, free))
        short = [(r, n, f) for r, n, f in report if n > f]
        if short:
            rank, n, f = short[0]
            raise CheckpointError(
                _disk_full_message(final, self.dir, n, f, rank, self.world_size, self.cfg.keep_last, "before writing")
            )

    def _raise_if_disk_full(self, error: BaseException, pending: _Pending) -> None:
        """Translate a write that ran out of space (ENOSPC, or torch's zip writer's "unexpected pos")
        into a CheckpointError; the partial folder is removed, the previous checkpoints are untouched."""
        if not _is_disk_full(error):
            return
        shutil.rmtree(pending.tmp, ignore_errors=True)
        free = shutil.disk_usage(_existing_ancestor(self.dir)).free
        raise CheckpointError(
            _disk_full_message(
                pending.final,
                self.dir,
                pending.needed,
                free,
                self.rank,
                self.world_size,
                self.cfg.keep_last,
                f"while writing ({type(error).__name__}: {_first_line(error)})",
            )
        ) from None

    def poll(self) -> None:
        """Commit a finished background save (cheap when none is pending)."""
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written and committed."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.future.result()
            self._commit(pending)
        except Exception as e:
            self._raise_if_disk_full(e, pending)
            raise
        logger.info("checkpoint step %d: written in the background to %s", pending.manifest["step"], pending.final)

    def _commit(self, pending: _Pending) -> None:
        """Rank 0: checksum the files, write the manifest, rename into place, drop old checkpoints.

        DCP's save returns on rank 0 only after every rank's data and the ``.metadata`` file
        are written, so rank 0 alone can commit.
        """
        if self.rank != 0:
            return
        files = sorted(p for p in pending.tmp.rglob("*") if p.is_file())
        pending.manifest["files"] = {
            str(p.relative_to(pending.tmp)): {"size": p.stat().st_size, "crc32": _crc32(p)} for p in files
        }
        (pending.tmp / "config.yaml").write_text(self.config_yaml)
        _write_atomic(pending.tmp / MANIFEST, json.dumps(pending.manifest, indent=1))
        if pending.final.exists():  # an unusable leftover at the same step (we resumed from an earlier one)
            shutil.rmtree(pending.final)
        os.replace(pending.tmp, pending.final)
        _fsync_dir(self.dir)
        if self.cfg.keep_last > 0:
            for old in list_checkpoints(self.dir)[: -self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------------------------ load

    def restore(self) -> Progress | None:
        """Load the checkpoint to start from, or return None to start fresh.

        ``load_from`` (a checkpoint folder, or a folder of them) wins; otherwise with ``resume``
        the newest checkpoint in ``dir``. A checkpoint that fails verification (truncated or
        corrupted files, a missing manifest) is skipped for the previous one when ``fallback``
        is set; otherwise, and for a checkpoint of an incompatible model, it raises
        :class:`CheckpointError`.
        """
        if self.cfg.load_from:
            candidates = self._explicit_candidates(Path(self.cfg.load_from))
        elif self.cfg.resume:
            candidates = list_checkpoints(self.dir)[::-1]
        else:
            return None
        if not candidates:
            logger.info("checkpoint: none in %s, starting from step 0", self.dir)
            return None
        probe = self._state(Progress())
        expected = self._fingerprint(probe)
        for path in candidates:
            problem = self._on_rank0(lambda path=path: self._verify(path, expected))
            if problem is None:
                problem = self._load(path, probe)
                if problem is None:
                    progress = Progress(**probe["progress"])
                    self._last_step = progress.step
                    self._adopt_lineage(path, probe["lineage"])
                    logger.info(
                        "checkpoint: resumed from %s (step %d, epoch %d, %d examples seen)",
                        path,
                        progress.step,
                        progress.epoch,
                        progress.examples,
                    )
                    return progress
            if not self.cfg.fallback or path == candidates[-1]:
                hint = "" if self.cfg.fallback else "; set checkpoint.fallback=true to fall back to the previous one"
                raise CheckpointError(f"{problem}{hint}")
            logger.warning("checkpoint: %s; falling back to the previous checkpoint", problem)
        raise AssertionError("unreachable")

    def _adopt_lineage(self, path: Path, loaded: str | None) -> None:
        """Continue the lineage of the checkpoint loaded from ``path``; one written before gem
        recorded lineages (``loaded`` None) leaves it unknown, and this run's checkpoints get a new id."""
        if loaded:
            self.lineage = loaded
            return
        logger.warning(
            "checkpoint: %s has no lineage id (written before gem recorded one), so its run is unknown; "
            "the checkpoints and deltas of this run get lineage %s",
            path,
            self.lineage,
        )

    def _explicit_candidates(self, path: Path) -> list[Path]:
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint.load_from={str(path)!r} does not exist; give a step_<N> folder "
                f"written by a gem run, or a folder of them (e.g. <run_dir>/checkpoints)"
            )
        if (path / ".metadata").exists() or (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
            return [path]
        found = list_checkpoints(path)[::-1]
        if not found:
            raise CheckpointError(f"checkpoint.load_from={str(path)!r} holds no step_<N> checkpoint folders")
        return found

    def _on_rank0(self, fn):
        """Run ``fn`` on rank 0 and give its result, or raise its exception, on every rank (so that
        an error on rank 0 never leaves the other ranks waiting for the collective timeout)."""
        out = [None]
        if self.rank == 0:
            try:
                out = [(True, fn())]
            except Exception as e:  # re-raised below on every rank
                out = [(False, e)]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(out, src=0)
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def _verify(self, path: Path, expected: dict[str, list]) -> str | None:
        """Rank 0: a reason why ``path`` is unusable, or None. Raises for an incompatible model."""
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return f"checkpoint {path}: no {MANIFEST}, so it is not a complete gem checkpoint"
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError as e:
            return f"checkpoint {path}: {MANIFEST} is corrupted ({e})"
        for name, want in manifest["files"].items():
            file = path / name
            if not file.is_file():
                return f"checkpoint {path}: file {name} is missing"
            size = file.stat().st_size
            if size != want["size"]:
                return (
                    f"checkpoint {path}: file {name} is truncated or overwritten "
                    f"({size} bytes, expected {want['size']})"
                )
            if self.cfg.verify == "checksum" and _crc32(file) != want["crc32"]:
                return f"checkpoint {path}: file {name} is corrupted (CRC-32 mismatch)"
        _check_compatible(path, manifest["fingerprint"], expected, self.config_yaml)
        return None

    def _load(self, path: Path, state: dict[str, Any]) -> str | None:
        """Load ``path`` into ``state`` and the live objects on every rank; a reason if any rank failed."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        saved_world_size = self._on_rank0(lambda: json.loads((path / MANIFEST).read_text())["world_size"])
        error = None
        flat, slots = flatten_state(state)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if "lineage" not in saved:  # written before gem recorded lineages
            container, name = slots.pop("lineage")
            del flat["lineage"]
            container[name] = None
        self._drop_stateless(flat, slots, saved)
        try:
            load_flat(flat, slots, path)
        except Exception as e:  # DCP raises CheckpointException with per-rank details
            error = f"checkpoint {path}: DCP could not read it on rank {self.rank} ({type(e).__name__}: {e})"
        errors = [error]
        if dist.is_initialized() and self.world_size > 1:
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error)
        if any(errors):
            return next(e for e in errors if e)
        sparse_module(self.model).load_state_dict(state["model"]["sparse"])
        self.model.dense_arch.load_state_dict(state["model"]["dense"])
        _load_fused(self.model, state["optim"]["sparse"], self._fused_keys)
        set_optimizer_state_dict(
            self.model.dense_arch, self.dense_opt, state["optim"]["dense"], options=flat_optim_options()
        )
        self.scheduler.load_state_dict(state["scheduler"])
        if saved_world_size == self.world_size:  # per-rank RNG streams only mean something at the same size
            _set_rng_state((path / f"rng_rank{self.rank}.pkl").read_bytes())
        else:
            logger.warning(
                "checkpoint: written by %d ranks, loading into %d (resharded); RNG states not restored",
                saved_world_size,
                self.world_size,
            )
        self._restore_loader(path, Progress(**state["progress"]))
        return None

    def _drop_stateless(self, flat: dict[str, Any], slots: dict[str, tuple[dict, str]], saved: dict[str, Any]) -> None:
        """Leave out of the load the dense parameters that had no optimizer state when the checkpoint
        (``saved``: its DCP entries) was saved (no gradient had reached them, e.g. the user tokens'
        projections of a model without a personalized FFN): AdamW creates its state lazily, and the
        probe of the state to load has created it for every parameter. They keep no state, as in the
        run that saved."""
        prefix = "optim.dense.state."
        param_of = {k: k.removeprefix(prefix).rsplit(".", 1)[0] for k in flat if k.startswith(prefix)}
        stateless = {p for k, p in param_of.items() if k not in saved}
        stateless -= {p for k, p in param_of.items() if k in saved}  # partly saved: an error below
        if not stateless:
            return
        for key in [k for k, p in param_of.items() if p in stateless]:
            container, name = slots.pop(key)
            del container[name], flat[key]
        params = dict(self.model.dense_arch.named_parameters())
        for name in stateless:
            self.dense_opt.state.pop(params[name], None)

    def _restore_loader(self, path: Path, progress: Progress) -> None:
        """Continue the training loader where the checkpoint's rank left it. A loader position
        belongs to one layout (world size, workers, batch size, files): under another one the
        interrupted epoch starts again from its beginning, with a warning."""
        if self.loader is None:
            return
        self.loader.set_epoch(progress.epoch)
        file = path / f"loader_rank{self.rank}.json"
        problem = None if file.is_file() else f"{file.name} is missing"
        if problem is None:
            try:
                self.loader.load_state_dict(json.loads(file.read_text()))
            except ValueError as e:
                problem = str(e)
        if problem is not None and progress.examples_in_epoch:
            logger.warning(
                "checkpoint: the data position cannot be restored (%s); epoch %d starts again from its "
                "first batch, so its first %d examples are seen twice",
                problem,
                progress.epoch,
                progress.examples_in_epoch,
            )


# ---------------------------------------------------------------------------------------- helpers


def new_lineage() -> str:
    """A new run's lineage id: 32 random hex digits."""
    return uuid.uuid4().hex


def flatten_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[dict, str]]]:
    """``{"a": {"b": x}}`` -> ``{"a.b": x}`` and, per flat key, the dict and key that hold the value.

    We flatten ourselves (DCP's own flattening is turned off on load) because DCP's load planner
    takes a checkpoint entry that this rank does not ask for (another rank's fused-optimizer
    table) for a sign of an old key format and re-flattens the request the old way.
    """
    flat, slots = {}, {}

    def visit(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                visit(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"], slots[f"{prefix}{k}"] = v, (node, k)

    visit(state, "")
    return flat, slots


def load_flat(flat: dict[str, Any], slots: dict[str, tuple[dict, str]], path: Path) -> None:
    """DCP's load of :func:`flatten_state`'s keys from ``path``, strictly (an entry this rank needs
    and the checkpoint lacks is an error); tensors load in place, other values go back into ``slots``."""
    dcp.load(
        flat,
        checkpoint_id=str(path),
        planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
    )
    for key, (container, name) in slots.items():
        container[name] = flat[key]


def _snapshot(flat: dict[str, Any]) -> dict[str, Any]:
    """A copy of the state for a background write, so that training may change the original.

    DCP's default stager does not take TorchRec's ShardedTensor, so we copy each kind ourselves:
    plain tensors into host memory; ShardedTensor and DTensor shards on their own device (their
    metadata names it), which on a GPU costs a second copy of this rank's shards in GPU memory.
    """
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.tensor import DTensor

    def copy(t):
        if isinstance(t, ShardedTensor):
            shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in t.local_shards()]
            return ShardedTensor._init_from_local_shards_and_global_metadata(shards, t.metadata())
        if isinstance(t, DTensor):
            return DTensor.from_local(
                t.to_local().detach().clone(),
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        if isinstance(t, torch.Tensor):
            return t.detach().to("cpu", copy=True)
        return copy_module.deepcopy(t)

    return {k: copy(v) for k, v in flat.items()}


class _AlreadyStaged:
    """An ``AsyncStager`` for state that :func:`_snapshot` has already copied."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def sparse_optim_state(model: nn.Module, sparse_opt) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Row-wise Adagrad momentum ``[rows]`` per table, keyed ``<table param>.momentum1`` whichever
    optimizer steps the table (so that a table may move between fused and data-parallel)."""
    out, fused_keys = {}, {}
    fused = getattr(model.sparse_arch, "fused_optimizer", None)
    if fused is not None:
        for fqn, states in fused.state_dict()["state"].items():
            for key, t in states.items():  # "<table>.momentum1"
                name = f"{fqn}.{key.rsplit('.', 1)[-1]}"
                out[name], fused_keys[name] = t, key
    if sparse_opt is not None:
        names = {id(p): n for n, p in sparse_module(model).named_parameters()}
        for p, st in sparse_opt.state.items():
            # TorchRec's RowWiseAdagrad keeps "sum" [rows, 1] and a step count (used only with lr_decay).
            out[f"{names[id(p)]}.momentum1"] = st["sum"].view(-1)
    return out, fused_keys


def _load_fused(model: nn.Module, loaded: dict[str, torch.Tensor], fused_keys: dict[str, str]) -> None:
    fused = getattr(model.sparse_arch, "fused_optimizer", None)
    if fused is None or not fused_keys:
        return
    state: dict[str, dict] = {}
    for name, key in fused_keys.items():
        state.setdefault(name.rsplit(".", 1)[0], {})[key] = loaded[name]
    fused.load_state_dict({"state": state})


def _check_compatible(path: Path, saved: dict[str, list], expected: dict[str, list], config_yaml: str) -> None:
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    shapes = sorted(k for k in set(saved) & set(expected) if saved[k] != expected[k])
    if not (missing or extra or shapes):
        return
    lines = [f"checkpoint {path} was written for a different model:"]
    for k in shapes[:5]:
        lines.append(f"  {k}: {saved[k][0]} {saved[k][1]} in the checkpoint, {expected[k][0]} {expected[k][1]} now")
    if missing:
        lines.append(f"  missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        lines.append(f"  not in this model: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    config_file = path / "config.yaml"
    if config_file.is_file():
        diff = _config_diff(config_file.read_text(), config_yaml, ("model", "sparse", "data.schema"))
        if diff:
            lines.append("  config keys that differ (checkpoint -> now): " + "; ".join(diff[:8]))
    lines.append("  use the checkpoint's model config (its config.yaml), or a new checkpoint.dir for a new model")
    raise CheckpointError("\n".join(lines))


def _config_diff(saved_yaml: str, now_yaml: str, prefixes: tuple[str, ...]) -> list[str]:
    def flat(node, prefix=""):
        if isinstance(node, dict):
            return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    a = flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    b = flat(OmegaConf.to_container(OmegaConf.create(now_yaml)))
    keys = sorted(k for k in set(a) | set(b) if k.startswith(prefixes) and a.get(k) != b.get(k))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


def _state_bytes(flat: dict[str, Any]) -> int:
    """About the bytes DCP writes for ``flat`` on this rank: its tensors' local shards plus about
    2 KiB per entry (torch.save's record of each entry and its line in ``.metadata``; measured:
    1.5 KiB per entry for the debug model), so rather over than under."""
    total = 2048 * len(flat)
    for value in flat.values():
        if hasattr(value, "local_shards"):  # ShardedTensor
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
        elif hasattr(value, "to_local"):  # DTensor
            local = value.to_local()
            total += local.numel() * local.element_size()
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        else:
            total += len(pickle.dumps(value))
    return total


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or one it wraps: its cause, context, DCP's per-rank failures) is a full disk."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if (
            "No space left on device" in text
            or "Disk quota exceeded" in text
            or ("inline_container.cc" in text and "unexpected pos" in text)
        ):
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            stack += [f for f in failures.values() if isinstance(f, BaseException)]
            stack += [f[0] for f in failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def _disk_full_message(
    final: Path, directory: Path, needed: int, free: int, rank: int, world_size: int, keep_last: int, when: str
) -> str:
    newest = list_checkpoints(directory)
    kept = f"the previous checkpoint {newest[-1]} is intact" if newest else "no earlier checkpoint was touched"
    on_rank = f" on rank {rank}" if world_size > 1 else ""
    need = f"about {_size(needed)}" if needed else "more"
    return (
        f"checkpoint {final}: no space left on device ({when}){on_rank}: the save needs {need}, "
        f"{_existing_ancestor(directory)} has {_size(free)} free. Free space on that disk, keep fewer checkpoints "
        f"(checkpoint.keep_last={keep_last}; older ones are deleted only after a save succeeds), or point "
        f"checkpoint.dir at a bigger disk; {kept}"
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def _rng_state() -> bytes:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(state)


def _set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
