"""Float8 projections (parallelism.float8, torchao): which layers convert, and that a converted
model computes what the bfloat16/float32 one does, within float8's precision. On the CPU torchao
emulates the scaled matmul, so this checks the wiring and the numbers, not the speed (docs/e2e.md
has the H200 measurement)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import gem
from gem.distributed.parallelize import float8_projections, parallelize_gem
from gem.train.config import ConfigError, validate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
TINY = ["debug=tiny", "model=gem_tiny", "sparse=native"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    data = gem.build_data(gem.compose([*TINY, f"data.cache_dir={tmp_path_factory.mktemp('cache')}"]))
    torch.manual_seed(0)
    return data, gem.build_model(data)


def test_only_wide_projections_outside_the_heads_convert(tiny):
    from torchao.float8.float8_linear import Float8Linear

    _, model = tiny
    dense = copy.deepcopy(model.dense_arch)
    linears = {n: m for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear)}
    chosen = float8_projections(dense, min_features=32)
    expected = [
        n
        for n, m in linears.items()
        if not n.startswith("heads")
        and min(m.in_features, m.out_features) >= 32
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
    ]
    assert chosen == expected and chosen, "the tiny model must have wide projections to convert"
    converted = {n for n, m in dense.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(chosen)
    assert any(n.startswith("heads") for n in linears) and not any(n.startswith("heads") for n in converted)


def test_float8_loss_and_gradients_follow_the_full_precision_model(tiny):
    data, model = tiny
    batch = next(iter(data.loader("train"))).to(data.device)
    fp8 = copy.deepcopy(model)
    parallelize_gem(fp8, None, float8_min_features=32)

    def loss_and_grads(m):
        m.zero_grad()
        loss, _ = data.loss(m(batch), batch)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in m.dense_arch.named_parameters() if p.grad is not None}

    (ref_loss, ref_grads), (loss, grads) = loss_and_grads(model), loss_and_grads(fp8)
    # e4m3 keeps 3 mantissa bits (relative rounding up to 1/16 per element); over a few layers the
    # loss moves by well under 1%, and each weight gradient points the same way (cosine > 0.95).
    assert loss == pytest.approx(ref_loss, rel=0.02)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[name].flatten(), dim=0)
        assert cos > 0.95, f"{name}: gradient cosine {cos:.3f}"


def test_float8_needs_torchao(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match="parallelism.float8=true needs torchao"):
        validate(gem.compose([*TINY, "parallelism.float8=true"]))


def test_the_trainer_trains_with_float8_projections(tmp_path):
    metrics = gem.train.train(
        gem.compose(
            [
                *TINY,
                "parallelism.float8=true",
                "parallelism.float8_min_features=32",
                f"data.cache_dir={tmp_path / 'cache'}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.max_steps=10",
                "trainer.plots=false",
            ]
        )
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert "float8 projections of width >= 32" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="float8 GEMMs need an SM89+ GPU",
)
def test_float8_trains_on_the_gpu_with_token_counts_off_the_alignment(tmp_path):
    """The scaled matmul wants every GEMM dimension a multiple of 16; the jagged token count, the
    weight gradient's inner dimension, almost never is (the first H200 run failed on T = 192,812)."""
    metrics = gem.train.train(
        gem.compose(
            [
                *TINY,
                "trainer.device=cuda",
                "trainer.autocast=bfloat16",
                "parallelism.float8=true",
                "parallelism.float8_min_features=32",
                f"data.cache_dir={tmp_path / 'cache'}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.max_steps=10",
                "trainer.plots=false",
            ]
        )
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
