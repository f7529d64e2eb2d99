"""benchmarks/attention.py: every variant a mode measures is a defined set of kernel settings (a
deleted setting left in a list would stop the benchmark on the GPU, after its first rows)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import attention
from kernels.jagged_attention.settings import KernelSettings

SETTINGS = {field.name for field in dataclasses.fields(KernelSettings)}


@pytest.mark.parametrize("mode", ["LENGTHS_VARIANTS", "FLAGSHIP_VARIANTS"])
def test_each_mode_measures_defined_variants(mode):
    names = getattr(attention, mode)
    assert names and set(names) <= set(attention.KERNEL_VARIANTS), set(names) - set(attention.KERNEL_VARIANTS)


def test_each_variant_sets_existing_settings_away_from_their_defaults_or_runs_an_unverified_kernel():
    defaults = KernelSettings()
    for name, values in attention.KERNEL_VARIANTS.items():
        assert set(values) <= SETTINGS, (name, set(values) - SETTINGS)
        changed = any(getattr(defaults, key) != value for key, value in values.items())
        assert changed != (name in attention.UNVERIFIED_VARIANTS), name
    assert attention._GDPA_ONLY <= SETTINGS and attention.UNVERIFIED_VARIANTS <= set(attention.KERNEL_VARIANTS)


def test_meta_gdpa_rows_call_tritonbench_where_installed(monkeypatch):
    """Meta's public GDPA (tritonbench) is a baseline of every unmasked GDPA case, in its three
    variants: unavailable without tritonbench, and with it called on gem's inputs with int32
    offsets, gem's scale and each variant's options (a stand-in module records the calls)."""
    import sys
    import types

    import torch

    from kernels.jagged_attention.inputs import make_inputs

    inputs = make_inputs([5, 0, 9], num_heads=2, head_dim=16, dtype=torch.float32)

    def names(activation, mask):
        return [name for name, _ in attention._baselines(inputs, activation, mask, compiled_reference=False)]

    meta = [name for name in names("fast_gelu", {}) if name.startswith("Meta GDPA")]
    assert len(meta) == 3
    assert not set(meta) & set(names("fast_gelu", {"causal": True})) and not set(meta) & set(names("softmax", {}))
    makers = [make for name, make in attention._baselines(inputs, "fast_gelu", {}, False) if name in meta]
    monkeypatch.setitem(sys.modules, "tritonbench", None)  # not installed
    with pytest.raises(ImportError):
        makers[0]()
    calls = []
    module = types.ModuleType("tritonbench.operators.gdpa.gdpa")
    module.gdpa = lambda *args, **kwargs: calls.append((args, kwargs)) or args[0]
    for name in ("tritonbench", "tritonbench.operators", "tritonbench.operators.gdpa"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "tritonbench.operators.gdpa.gdpa", module)
    for make in makers:
        make()()
    (args, plain), (_, fast), (_, fast_sorted) = calls
    assert args[3].dtype == args[4].dtype == torch.int32 and args[5:] == (9, 9)
    assert plain == dict(qk_scale=0.25, activation="fast_gelu", is_causal=False)
    assert fast["enable_persistent"] and fast["enable_tma"] and "seq_index" not in fast
    assert fast_sorted["seq_index"].tolist() == [2, 0, 1]
