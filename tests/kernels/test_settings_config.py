"""The kernels' settings as the run sets them: configs/kernels/ (``kernels.*``) and
``experimental.kernels.*`` -> settings.resolve -> the model's attention modules.

One source of defaults, ``KernelSettings``: gem's typed schema is made from its fields, split into
the user's and the experimental ones; no option of the group changes a setting; a config value
reaches the kernels unless one of the few debugging variables (``GEM_KERNELS_*``) overrides it,
with a warning; an experimental key under its old name still works, with a warning.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gem.train.config import EXPERIMENTAL_KERNEL_SETTINGS, Config, ConfigError, kernel_settings_of, validate
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
    assert kernel_settings_of(Config()) == defaults
    config = validate(compose([f"kernels={option}", "model=dlrm"]))
    assert kernel_settings_of(config) == defaults
    assert set(dataclasses.asdict(config.experimental.kernels)) == set(EXPERIMENTAL_KERNEL_SETTINGS)
    assert config.kernels.attention_backend == {"auto": None}.get(option, option)


def test_a_config_value_reaches_the_kernels_unless_the_environment_overrides_it(restored, monkeypatch):
    config = validate(compose(["model=dlrm", "kernels.gluon=false", "experimental.kernels.gluon_min_q_len=256"]))
    applied = kernel_config.configure(**kernel_settings_of(config))
    assert (applied.gluon, applied.gluon_min_q_len) == (False, 256)
    assert kernel_config.current() is applied
    monkeypatch.setenv("GEM_KERNELS_GLUON", "1")
    with pytest.warns(UserWarning, match="GEM_KERNELS_GLUON overrides kernels.gluon=False with True"):
        assert kernel_config.configure(**kernel_settings_of(config)).gluon is True


def test_an_experimental_key_under_its_old_name_moves_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="gem.train.config"):
        config = validate(compose(["model=dlrm", "kernels.gluon_compiled=true", "parallelism.residual_addmm=false"]))
    assert config.experimental.kernels.gluon_compiled is True and kernel_settings_of(config)["gluon_compiled"]
    assert config.experimental.parallelism.residual_addmm is False
    assert config.kernels.gluon_compiled is None and config.parallelism.residual_addmm is None
    moved = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(moved) == 2 and "it is experimental.kernels.gluon_compiled now" in moved[0]


def test_bad_kernel_values_name_the_key():
    with pytest.raises(ConfigError, match="experimental.kernels.tune_space='narrow'"):
        validate(compose(["model=dlrm", "experimental.kernels.tune_space=narrow"]))
    with pytest.raises(ConfigError, match="experimental.kernels.store_ds_max_mib=-1"):
        validate(compose(["model=dlrm", "experimental.kernels.store_ds_max_mib=-1"]))


def test_the_trainer_hands_the_settings_to_the_model(restored, tmp_path):
    """The config's settings reach every attention module of the built model (gem_tiny: its
    self-attention, personalized FFNs and pooling), not the process default."""
    from gem.models.sequence import ATTENTION_MODULES
    from gem.train.setup import build_model, init_distributed, load_data

    config = validate(
        compose(
            [
                "debug=tiny",
                "model=gem_tiny",
                "sparse=native",
                f"data.cache_dir={tmp_path / 'cache'}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "experimental.kernels.gluon_min_q_len=512",
                "kernels.store_ds=false",
            ]
        )
    )
    env = init_distributed("cpu", need_process_group=False)
    schema, _ = load_data(config, env)
    default = kernel_config.configure()
    model = build_model(config, schema, env)
    modules = [m for m in model.modules() if isinstance(m, ATTENTION_MODULES)]
    assert {type(m).__name__ for m in modules} >= {"JaggedSelfAttention", "PersonalizedFFN"}
    for module in modules:
        assert (module.kernel_settings.gluon_min_q_len, module.kernel_settings.store_ds) == (512, False)
    assert kernel_config.current() is default == kernel_config.KernelSettings()


def test_a_module_with_its_own_settings_compiles_in_one_graph(restored):
    """A module's settings reach its calls under torch.compile(fullgraph=True): rotary_fused on in
    the module, off in the process default, traces the fused rotary op; outputs as eager."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from gem.models.sequence import JaggedSelfAttention, use_kernel_settings

    torch.manual_seed(0)
    layer = JaggedSelfAttention(32, 2, backend="triton")
    assert use_kernel_settings(layer, kernel_config.KernelSettings(rotary_fused=True)) == 1
    assert not kernel_config.current().rotary_fused
    x = torch.randn(11, 32)
    offsets = torch.tensor([0, 4, 4, 11])
    graphs = EagerAndRecordGraphs()
    torch._dynamo.reset()
    out = torch.compile(layer, fullgraph=True, backend=graphs)(x, offsets, 7)
    torch.testing.assert_close(out, layer(x, offsets, 7))
    (graph,) = graphs.graphs
    ops = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "gem_kernels.rotary_self_attention_fwd" in ops


@pytest.mark.parametrize("key", ["experimental.kernels.gluon_bwd_softmax", "kernels.gluon_bwd_softmax"])
def test_a_deleted_setting_is_an_error_that_says_so(key, restored, monkeypatch):
    with pytest.raises(ConfigError, match=f"{key}: the kernel setting gluon_bwd_softmax was deleted"):
        validate(compose(["model=dlrm", f"+{key}=true"]))
    with pytest.raises(ValueError, match="kernels.gluon_bwd_softmax: the kernel setting gluon_bwd_softmax was deleted"):
        kernel_config.configure(gluon_bwd_softmax=True)
    monkeypatch.setenv("GEM_KERNELS_GLUON_BWD_SOFTMAX", "1")
    with pytest.raises(ValueError, match="GEM_KERNELS_GLUON_BWD_SOFTMAX: the kernel setting gluon_bwd_softmax was"):
        kernel_config.configure()
