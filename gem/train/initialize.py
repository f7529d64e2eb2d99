"""Start some of a model's tensors from another run's checkpoint, and freeze some (parameter sharing).

``checkpoint.init_from=<step_N folder>`` with ``checkpoint.init_modules=[prefix, ...]`` loads the
tensors of the model whose names start with one of the prefixes (model names, as
``model.named_parameters()`` of an unwrapped GEMModel gives them: ``sparse_arch.ebc.embedding_bags.t_item``,
``sparse_arch``, ``dense_arch.blocks.0``) from a DCP checkpoint that another run wrote, bit-exact,
whichever sparse backend or TorchRec plan either run used (DCP reshards; only the global shape must
match). A prefix matching nothing, a tensor the checkpoint lacks, or one of another shape or
dtype is a :class:`gem.train.checkpoint.CheckpointError` that names the key and both shapes.

``checkpoint.init_frozen=[prefix, ...]`` freezes tensors: dense parameters and unfused tables get
``requires_grad=False`` (the optimizers leave them out); a table TorchRec fused into FBGEMM's
backward gets learning rate 0 in its own kernel group (``shard_sparse_arch(frozen_tables=...)``
gives frozen tables their own group), which leaves its weights bit-identical (its Adagrad
momentum still accumulates, unused).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from gem.train.checkpoint import MANIFEST, CheckpointError, list_checkpoints, sparse_module
from gem.train.logging import logger

__all__ = [
    "checkpoint_key",
    "freeze",
    "frozen_tables",
    "init_from_checkpoint",
    "manifest_shapes",
    "matches",
    "model_state",
    "resolve_checkpoint",
]

# model name prefix -> checkpoint key prefix
_SECTIONS = (("sparse_arch.", "model.sparse."), ("dense_arch.", "model.dense."))


def resolve_checkpoint(path: str | Path, key: str = "checkpoint.init_from") -> Path:
    """A committed ``step_<N>`` folder: ``path`` itself, or the newest one inside it."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{key}={str(path)!r} does not exist; give a step_<N> folder written by a gem run "
            f"(or a folder of them, e.g. <run_dir>/checkpoints)"
        )
    if not (path / MANIFEST).is_file():
        found = list_checkpoints(path)
        if not found:
            raise CheckpointError(
                f"{key}={str(path)!r} is neither a finished gem checkpoint (no {MANIFEST}) nor a "
                f"folder of step_<N> checkpoints"
            )
        path = found[-1]
    return path


def manifest_shapes(path: Path) -> dict[str, list]:
    """``{checkpoint key: [global shape, dtype]}`` from the checkpoint's manifest."""
    return json.loads((path / MANIFEST).read_text())["fingerprint"]


def matches(name: str, prefixes: Iterable[str]) -> bool:
    """Whether ``name`` is one of ``prefixes`` or lies under one (dotted boundary)."""
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{model name: tensor}`` of the state DCP writes under ``model.*`` (ShardedTensors for
    TorchRec-sharded tables, DTensors under FSDP2, plain tensors otherwise)."""
    out = {f"sparse_arch.{k}": v for k, v in sparse_module(model).state_dict().items()}
    out |= {f"dense_arch.{k}": v for k, v in model.dense_arch.state_dict().items()}
    return out


def checkpoint_key(name: str) -> str:
    for model_prefix, ckpt_prefix in _SECTIONS:
        if name.startswith(model_prefix):
            return ckpt_prefix + name[len(model_prefix) :]
    raise ValueError(name)


def _shape(t) -> tuple[list[int], str]:
    return list(t.size()), str(t.dtype).removeprefix("torch.")


def _unmatched(prefixes: Sequence[str], names: Iterable[str], key: str) -> None:
    names = list(names)
    for p in prefixes:
        if not any(matches(n, [p]) for n in names):
            near = sorted({".".join(n.split(".")[:4]) for n in names})[:12]
            raise CheckpointError(
                f"{key}: {p!r} matches no tensor of this model; names start with "
                f"sparse_arch. or dense_arch., e.g. {near}"
            )


def init_from_checkpoint(model: nn.Module, path: str | Path, modules: Sequence[str]) -> list[str]:
    """Load the tensors of ``model`` under ``modules`` from the checkpoint ``path``; returns their names.

    Runs on every rank (DCP reads each rank's shards); the checks run before any read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    path = resolve_checkpoint(path)
    if not modules:
        raise CheckpointError(
            f"checkpoint.init_from={str(path)!r} needs checkpoint.init_modules: the name prefixes "
            "to load, e.g. [sparse_arch.ebc.embedding_bags.t_ad_id, dense_arch]"
        )
    saved = manifest_shapes(path)
    state = model_state(model)
    _unmatched(modules, state, "checkpoint.init_modules")
    chosen = [n for n in state if matches(n, modules)]
    problems = []
    for name in chosen:
        key, want = checkpoint_key(name), _shape(state[name])
        if key not in saved:
            problems.append(
                f"  {name}: not in the checkpoint (key {key}; it holds "
                f"{sorted(k for k in saved if k.startswith('model.'))[:6]} ...)"
            )
        elif list(saved[key]) != list(want):
            problems.append(
                f"  {name}: {saved[key][0]} {saved[key][1]} in the checkpoint, {want[0]} {want[1]} in this model"
            )
    if problems:
        raise CheckpointError(
            f"checkpoint.init_from={path}: cannot load checkpoint.init_modules={list(modules)}:\n"
            + "\n".join(problems[:10])
            + ("\n  ..." if len(problems) > 10 else "")
            + "\n  share only tensors of equal shape (the same table cardinality and "
            "sparse.embedding_dim / sparse.dims, the same dense layer sizes)"
        )
    flat = {checkpoint_key(n): state[n] for n in chosen}
    dcp.load(
        flat,
        checkpoint_id=str(path),
        planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
    )
    # The loaded tensors are the state dicts' own (in place); load them back as the checkpointer does,
    # for modules whose state_dict() hands out copies.
    sparse_state = {k.removeprefix("sparse_arch."): v for k, v in state.items() if k.startswith("sparse_arch.")}
    dense_state = {k.removeprefix("dense_arch."): v for k, v in state.items() if k.startswith("dense_arch.")}
    sparse_module(model).load_state_dict(sparse_state)
    model.dense_arch.load_state_dict(dense_state)
    logger.info("checkpoint.init_from: loaded %d tensors (%s) from %s", len(chosen), ", ".join(modules), path)
    return chosen


def frozen_tables(model_or_arch: nn.Module, prefixes: Sequence[str]) -> list[str]:
    """Names of the tables (``TableSpec.name``) of a SparseArch whose weights ``prefixes`` freeze."""
    arch = getattr(model_or_arch, "sparse_arch", model_or_arch)
    arch = arch.module if hasattr(arch, "module") else arch
    out = []
    for t in arch.tables:
        name = f"sparse_arch.{'ebc.embedding_bags' if t.pooled else 'ec.embeddings'}.{t.name}.weight"
        if matches(name, prefixes):
            out.append(t.name)
    return out


def _fused_leaves(opt, prefix: str = ""):
    """(name prefix, optimizer) of every leaf of TorchRec's (nested) CombinedOptimizer."""
    subs = getattr(opt, "optimizers", None)
    if subs is None:
        yield prefix, opt
        return
    for name, sub in subs:
        yield from _fused_leaves(sub, f"{prefix}{name}." if name else prefix)


def freeze(model: nn.Module, prefixes: Sequence[str]) -> list[str]:
    """Freeze the tensors of ``model`` under ``prefixes`` (before the optimizers are built); returns their names."""
    if not prefixes:
        return []
    arch = sparse_module(model)
    params = {f"sparse_arch.{n}": p for n, p in arch.named_parameters()}
    params |= {f"dense_arch.{n}": p for n, p in model.dense_arch.named_parameters()}
    fused = getattr(model.sparse_arch, "fused_optimizer", None)
    fused_names: dict[str, object] = {}
    if fused is not None:
        for prefix, leaf in _fused_leaves(fused):
            for key in getattr(leaf, "params", {}):
                fused_names[f"sparse_arch.{prefix}{key}"] = leaf
    _unmatched(prefixes, set(params) | set(fused_names), "checkpoint.init_frozen")
    out = []
    for name, p in params.items():
        if matches(name, prefixes) and name not in fused_names:
            p.requires_grad_(False)
            out.append(name)
    for leaf in {id(v): v for v in fused_names.values()}.values():
        names = [n for n, v in fused_names.items() if v is leaf]
        frozen = [n for n in names if matches(n, prefixes)]
        if not frozen:
            continue
        if len(frozen) != len(names):
            raise CheckpointError(
                f"checkpoint.init_frozen: {frozen} share one FBGEMM kernel with {sorted(set(names) - set(frozen))}, "
                "which are not frozen; the sharding must give frozen tables their own group "
                "(shard_sparse_arch(frozen_tables=...))"
            )
        for group in leaf.param_groups:
            group["lr"] = 0.0
            group.pop("initial_lr", None)
        out += frozen
    logger.info("checkpoint.init_frozen: %d tensors frozen (%s)", len(out), ", ".join(prefixes))
    return sorted(out)
