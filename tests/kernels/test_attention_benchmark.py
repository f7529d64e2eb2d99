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
