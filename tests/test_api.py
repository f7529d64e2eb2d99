"""The library API (gem.train.api, exported by ``gem``): a loop written on it trains exactly like
``train()``, ``import gem`` stays cheap, and the examples run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import gem
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_import_gem_loads_neither_torch_nor_hydra():
    code = (
        "import sys, gem, gem.train; gem.compose; gem.train.build_data; "
        "print('torch' in sys.modules, 'hydra' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


def test_a_loop_on_the_api_trains_like_train(cache_dir, tmp_path):
    """compose -> build_data -> build_model -> build_optimizers, then plain forward / loss / backward /
    step: the same per-step losses as train() on the same config (TorchRec-sharded tables with the
    fused optimizer, a warm-up and a cosine schedule), and evaluate() gives the val metrics."""
    overrides = [
        "debug=tiny",
        f"data.cache_dir={cache_dir}",
        f"trainer.run_dir={tmp_path}",
        "trainer.max_steps=6",
        "trainer.log_every=1",
        "optim.warmup_steps=2",
        "optim.schedule=cosine",
    ]
    gem.train.train(gem.compose(overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = [r["loss"] for r in rows if r["kind"] == "train"]
    if dist.is_initialized():
        dist.destroy_process_group()

    data = gem.build_data(gem.compose(overrides))
    model = gem.build_model(data)
    assert getattr(model.sparse_arch, "fused_optimizer", None) is not None  # sharded tables, fused Adagrad
    opt = gem.build_optimizers(model, data, total_steps=6)
    losses = []
    for _, batch in zip(range(6), data.loader("train")):
        batch = batch.to(data.device)
        opt.zero_grad()
        loss, _ = data.loss(model(batch), batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-6), (losses, expected)
    metrics = gem.evaluate(model, data, "val")
    assert metrics["click/count"] == 300 and 0 < metrics["click/auc"] < 1
    assert model.training
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_api_model_starts_from_init_from_and_freezes_init_frozen(cache_dir, tmp_path):
    """build_model initializes as the trainer's set-up does: a custom loop's model with
    ``checkpoint.init_from`` holds that checkpoint's tensors, and ``init_frozen``'s are frozen."""
    from gem.train.checkpoint import list_checkpoints
    from gem.train.initialize import model_state
    from gem.transfer.teacher import load_teacher

    base = ["debug=tiny", "sparse=native", f"data.cache_dir={cache_dir}", "trainer.plots=false", "trainer.test=false"]
    pre = tmp_path / "pre"
    gem.train.train(gem.compose([*base, f"trainer.run_dir={pre}", "trainer.max_steps=2", "checkpoint.enabled=true"]))
    step = list_checkpoints(pre / "checkpoints")[-1]
    run = [*base, f"trainer.run_dir={tmp_path / 'loop'}"]
    random = model_state(gem.build_model(gem.build_data(gem.compose(run))))
    data = gem.build_data(
        gem.compose(
            [
                *run,
                f"checkpoint.init_from={step}",
                "checkpoint.init_modules=[sparse_arch,dense_arch]",
                "checkpoint.init_frozen=[sparse_arch]",
            ]
        )
    )
    model = gem.build_model(data)
    saved = load_teacher(step, data.schema, None, data.device).model
    want = {f"sparse_arch.{k}": v for k, v in saved.sparse_arch.state_dict().items()}
    want |= {f"dense_arch.{k}": v for k, v in saved.dense_arch.state_dict().items()}
    got = model_state(model)
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    assert any(not torch.equal(random[name], want[name]) for name in want)  # trained, not the seed's weights
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("sparse_arch.") for n in frozen)
    assert all(p.requires_grad for p in model.dense_arch.parameters())


def test_two_components_wrapping_the_dense_arch_are_refused(cache_dir, tmp_path, monkeypatch):
    """As in train(), at most one registered component may wrap the dense arch."""
    from gem.train import registry
    from gem.train.config import ConfigError

    for section in ("tests.first", "tests.second"):
        monkeypatch.setitem(registry._REGISTRY, section, "tests.test_api:_wrapping_component")
    data = gem.build_data(
        gem.compose(["debug=tiny", "sparse=native", f"data.cache_dir={cache_dir}", f"trainer.run_dir={tmp_path}"])
    )
    with pytest.raises(ConfigError, match="2 components wrap the dense arch; at most one may"):
        gem.build_model(data)


def _wrapping_component(config):
    from gem.train.components import Component

    class Wrapping(Component):
        def dense_builder(self):
            return lambda schema, feature_dims, build: build()

    return Wrapping()


def test_compose_works_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = gem.compose(["model=gem_tiny"])
    assert cfg.model._target_.endswith("GEMDenseArch") and cfg.trainer.run_dir == "runs/default"


def _run(script, *args, env=None):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_example_custom_loop(cache_dir):
    out = _run("custom_loop.py", f"data.cache_dir={cache_dir}", "steps=12", "sparse=native")
    assert "step 12 loss" in out and "val click/auc=" in out, out


def test_example_kernel_only():
    out = _run("kernel_only.py", env={"TRITON_INTERPRET": "1"})
    assert "backends run: reference, triton" in out, out
    for line in out.splitlines()[:2]:
        diffs = [float(w.rstrip(",")) for w in line.split("diff ")[1:] for w in [w.split()[0]]]
        assert len(diffs) == 2 and max(diffs) < 1e-4, line


@pytest.mark.parametrize("package", ["gem.data", "gem.models", "gem.sparse", "gem.train", "gem.distributed"])
def test_each_package_exports_what_it_lists(package):
    """Every public name of a package's ``__all__`` resolves (they are imported on first use)."""
    import importlib

    module = importlib.import_module(package)
    assert module.__all__
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package}.__all__ lists names it cannot give: {missing}"


def test_the_readme_snippet_trains_the_steps_it_schedules(tmp_path):
    """README's library-API loop, run as printed: it steps the optimizers as many times as the
    total_steps it gives their schedule (issue 70: it read as 100 steps and trained one epoch, 31)."""
    import re

    readme = (ROOT / "README.md").read_text()
    (snippet,) = [s for s in re.findall(r"```python\n(.*?)```", readme, re.S) if "gem.build_optimizers" in s]
    counting = (  # plain tables (sparse=native) for speed: the loop's length is the data's
        "import gem\n"
        "compose = gem.compose\n"
        "gem.compose = lambda overrides: compose([*overrides, 'sparse=native'])\n"
        "build, steps, asked = gem.build_optimizers, [], []\n"
        "def build_optimizers(model, data, total_steps):\n"
        "    opt = build(model, data, total_steps)\n"
        "    step, asked[:] = opt.step, [total_steps]\n"
        "    opt.step = lambda: (steps.append(1), step())\n"
        "    return opt\n"
        "gem.build_optimizers = build_optimizers\n"
    )
    code = counting + snippet + "print('steps', len(steps), 'scheduled', asked[0])\n"
    env = {**os.environ, "GEM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps, scheduled = map(int, re.search(r"steps (\d+) scheduled (\d+)", proc.stdout).groups())
    assert steps == scheduled, proc.stdout[-2000:]
    claimed = re.search(r"# one epoch: (\d+) batches", snippet)
    assert claimed and int(claimed.group(1)) == steps, snippet
