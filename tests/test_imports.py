"""The import graph of gem and kernels: dependencies point one way, and no module imports itself
back through others (docs/design.md, "Layers").

Every import counts, those inside functions too (read from the source with ``ast``). A package's
``__main__`` is a program, not a layer: it may wire in the packages above it (``python -m
gem.train`` registers gem.transfer's component).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests.conftest import ROOT

# lowest first; a module imports only from its own package and from lower layers
LAYERS = (
    ("kernels", "gem.versions"),
    ("gem.data",),
    ("gem.sparse",),
    ("gem.models",),
    ("gem.distributed",),
    ("gem.train",),
    ("gem.plan", "gem.transfer"),
    ("gem",),
)


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("gem", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


MODULES = _modules()


def _module_of(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    """The gem / kernels modules ``path`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [s for s in subs if s in MODULES] + ([node.module] if any(s not in MODULES for s in subs) else [])
        else:
            continue
        out |= {m for n in names if n.split(".")[0] in ("gem", "kernels") and (m := _module_of(n))}
    return out


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(module: str) -> tuple[int, str]:
    """(rank, package) of the most specific entry of LAYERS that holds ``module``."""
    best = None
    for rank, packages in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and (
                best is None or len(package) > len(best[1])
            ):
                best = (rank, package)
    assert best is not None, module
    return best


def test_every_package_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_nothing_imports_up_or_sideways():
    wrong = []
    for module, imported in GRAPH.items():
        if module.endswith("__main__"):
            continue
        rank, package = _layer(module)
        for other in imported:
            other_rank, other_package = _layer(other)
            if other_package != package and other_rank >= rank:
                wrong.append(f"{module} ({package}) imports {other} ({other_package})")
    assert not wrong, "\n".join(sorted(wrong))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert not _cycles(GRAPH)


def test_the_checks_find_a_circle_and_an_upward_import():
    """The checks themselves: the circle the trainer once had (api -> trainer -> transfer.student
    -> transfer.export -> api) is found."""
    graph = {
        "gem.train.api": {"gem.train.trainer"},
        "gem.train.trainer": {"gem.transfer.student"},
        "gem.transfer.student": {"gem.transfer.export"},
        "gem.transfer.export": {"gem.train.api"},
    }
    assert _cycles(graph) == [sorted(graph)]
    assert _layer("gem.transfer.student")[0] > _layer("gem.train.trainer")[0]


def test_names_moved_out_of_the_trainer_resolve_with_a_deprecation_warning():
    """gem.train.trainer's names of before gem.train.setup / gem.train.evaluation still resolve, with a
    DeprecationWarning naming the new import; those folded into other functions say what replaced them."""
    from gem.train import trainer

    moved = {
        "DistEnv": "gem.train.setup",
        "init_distributed": "gem.train.setup",
        "seed_everything": "gem.train.setup",
        "load_data": "gem.train.setup",
        "parallel_dims": "gem.train.setup",
        "build_model": "gem.train.setup",
        "split_loader": "gem.train.setup",
        "apply_transfer": "gem.train.setup",
        "score_partition": "gem.train.evaluation",
        "stream_summary": "gem.train.evaluation",
    }
    for name, module in moved.items():
        new = "initialize" if name == "apply_transfer" else name
        with pytest.warns(DeprecationWarning, match=f"from {module} import {new}"):
            assert getattr(trainer, name) is getattr(importlib.import_module(module), new)
    for name, replacement in [
        ("check_eval_splits", "gem.train.setup.plan"),
        ("distill_loss", "gem.transfer.components.Distillation.loss"),
        ("pretrain_stage", "gem.train.pretrain.stage_and_run"),
    ]:
        with pytest.raises(AttributeError, match=replacement):
            getattr(trainer, name)
    with pytest.raises(AttributeError):
        trainer.no_such_name  # noqa: B018
    assert not set(moved) & set(trainer.__all__)
