"""The kernels' settings as the run sets them: configs/kernels/ -> KernelsConfig -> settings.configure.

One source of defaults, ``KernelSettings``: gem's typed schema is made from its fields, no option
of the group changes a setting, and a config value reaches the kernels unless its
``GEM_KERNELS_*`` variable overrides it.
"""

from __future__ import annotations

import dataclasses

import pytest

from gem.train.config import ConfigError, KernelsConfig, validate
from kernels.jagged_attention import settings as kernel_config
from kernels.jagged_attention import testing
from tests.conftest import compose


@pytest.fixture
def restored(monkeypatch):
    """No GEM_KERNELS_* variable set; the settings in force restored after the test."""
    for name in kernel_config.ENV.values():
        monkeypatch.delenv(name, raising=False)
    with testing.preserved():
        yield


@pytest.mark.parametrize("option", ["auto", "triton", "reference"])
def test_every_option_of_the_group_keeps_the_settings_defaults(option):
    defaults = dataclasses.asdict(kernel_config.KernelSettings())
    assert KernelsConfig().kernel_settings() == defaults
    config = validate(compose([f"kernels={option}", "model=dlrm"]))
    assert config.kernels.kernel_settings() == defaults
    assert config.kernels.attention_backend == {"auto": None}.get(option, option)


def test_a_config_value_reaches_the_kernels_unless_the_environment_overrides_it(restored, monkeypatch):
    config = validate(compose(["model=dlrm", "kernels.store_ds=false", "kernels.gluon_min_q_len=256"]))
    applied = kernel_config.configure(**config.kernels.kernel_settings())
    assert (applied.store_ds, applied.gluon_min_q_len) == (False, 256)
    assert kernel_config.current() is applied
    monkeypatch.setenv("GEM_KERNELS_STORE_DS", "1")
    assert kernel_config.configure(**config.kernels.kernel_settings()).store_ds is True


def test_bad_kernel_values_name_the_key():
    with pytest.raises(ConfigError, match="kernels.tune_space='narrow'"):
        validate(compose(["model=dlrm", "kernels.tune_space=narrow"]))
    with pytest.raises(ConfigError, match="kernels.store_ds_max_mib=-1"):
        validate(compose(["model=dlrm", "kernels.store_ds_max_mib=-1"]))


def test_the_trainer_applies_the_settings_before_it_builds_the_model(restored, tmp_path):
    from gem.train.trainer import build_model, init_distributed, load_data

    config = validate(
        compose(
            [
                "debug=tiny",
                "sparse=native",
                f"data.cache_dir={tmp_path / 'cache'}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "kernels.gluon_min_q_len=512",
                "kernels.store_ds=false",
            ]
        )
    )
    env = init_distributed("cpu", need_process_group=False)
    schema, _ = load_data(config, env)
    assert kernel_config.configure() == kernel_config.KernelSettings()
    build_model(config, schema, env)
    applied = kernel_config.current()
    assert (applied.gluon_min_q_len, applied.store_ds) == (512, False)
