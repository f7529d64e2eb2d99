import logging
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from gem.train.config import ConfigError, validate
from tests.conftest import CONFIG_DIR, compose

GROUPS = sorted(p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir())


def test_every_group_is_documented_in_design():
    assert GROUPS == [
        "data",
        "debug",
        "experiment",
        "kernels",
        "model",
        "optim",
        "parallelism",
        "plan",
        "sparse",
        "trainer",
    ]


@pytest.mark.parametrize(
    "group, option", [(g, p.stem) for g in GROUPS for p in sorted((Path(CONFIG_DIR) / g).glob("*.yaml"))]
)
def test_every_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if option == "parquet":
        overrides.append("data.dir=/some/dataset")
    config = validate(compose(overrides))
    assert config.model["_target_"].startswith("gem.models.")
    assert config.trainer.run_dir == f"runs/{config.name}"


@pytest.mark.parametrize(
    "override, match",
    [
        ("trainer.devcie=cpu", "trainer.devcie"),
        ("trainer.max_steps=ten", "trainer.max_steps"),
        ("trainer.max_steps=-5", "trainer.max_steps=-5: give a number of steps >= 1, or -1 for trainer.epochs"),
        ("trainer.max_steps=0", "trainer.max_steps=0: give a number of steps >= 1"),
        ("sparse.backend=fbgemm", "sparse.backend='fbgemm' is not one of"),
        ("optim.dense.lr=-1", "optim.dense.lr=-1.0 must be > 0"),
        ("data.batch_size=0", "data.batch_size=0 must be > 0"),
        ("trainer.device=tpu", "trainer.device='tpu'"),
        ("sparse.sharding_type=diagonal", "sparse.sharding_type='diagonal'"),
        ("optim.schedule=linear", "optim.schedule"),
    ],
)
def test_bad_values_name_the_key(override, match):
    """Composition starts from the typed schema, so Hydra refuses a wrong type or an unknown key
    while composing (its message names the key); validate() names the rest."""
    key = override.split("=")[0]
    with pytest.raises((ConfigError, ConfigCompositionException), match=match) as e:
        validate(compose([f"+{override}" if key == "trainer.devcie" else override]))
    if isinstance(e.value, ConfigCompositionException):  # Hydra's message keeps the key in its cause
        assert key in f"{e.value} {e.value.__cause__}"


def test_table_weight_decay_is_checked():
    """optim.sparse.weight_decay: >= 0, and only with the row-wise Adagrad it is built into."""
    assert validate(compose([])).optim.sparse.weight_decay == 0.0
    assert validate(compose(["optim.sparse.weight_decay=1e-3"])).optim.sparse.weight_decay == 1e-3
    with pytest.raises(ConfigError, match=r"optim.sparse.weight_decay=-0.1 must be >= 0"):
        validate(compose(["optim.sparse.weight_decay=-0.1"]))
    with pytest.raises(
        ConfigError,
        match=r"optim.sparse.weight_decay=0.001 .* optim.sparse.name='adagrad'; set optim.sparse.name=rowwise_adagrad, "
        r"or optim.sparse.weight_decay=0",
    ):
        validate(compose(["optim.sparse.weight_decay=1e-3", "optim.sparse.name=adagrad"]))
    validate(compose(["optim.sparse.weight_decay=0", "optim.sparse.name=adagrad"]))


def test_inductor_options_are_flattened_and_checked_against_torch(caplog):
    """parallelism.inductor reaches torch.compile as ``options`` with dotted keys; a misspelt key
    stops the run at start with the close matches, and options without compile are dropped with a
    warning (gem_base_h200 sets CUDA graphs; its eager runs must still start)."""
    on = ["parallelism.compile=true"]
    options = ["+parallelism.inductor.combo_kernels=true", "+parallelism.inductor.triton.cudagraphs=false"]
    config = validate(compose([*on, *options]))
    assert config.parallelism.inductor == {"combo_kernels": True, "triton.cudagraphs": False}
    assert validate(compose(on)).parallelism.inductor == {}
    with pytest.raises(ConfigError, match="inductor.combo_kernel is not an option .* did you mean combo_kernels"):
        validate(compose([*on, "+parallelism.inductor.combo_kernel=true"]))
    with caplog.at_level(logging.WARNING, logger="gem.train.config"):
        assert validate(compose(["+parallelism.inductor.combo_kernels=true"])).parallelism.inductor == {}
    assert "parallelism.inductor (combo_kernels) ignored: parallelism.compile=false" in caplog.text
    with pytest.raises(ConfigError, match="inductor.combo_kernel is not an option"):  # checked all the same
        validate(compose(["+parallelism.inductor.combo_kernel=true"]))


def test_parquet_needs_a_directory():
    with pytest.raises(ConfigError, match="data.dir is required"):
        validate(compose(["data=parquet", "data.dir=null"]))


@pytest.mark.parametrize("data", ["synthetic", "parquet", "seqrec"])
def test_the_fix_a_data_error_prints_works_as_printed(tmp_path, tiny_schema, data):
    """Issue #27.3: errors suggest `data.loader.on_error.<case>=skip`, which Hydra rejected (only
    `+data.loader...` worked); the config schema declares data.loader's keys, so the printed override composes."""
    import re

    import pyarrow as pa

    from gem.data.format.checks import error_policy
    from gem.data.format.layout import write_parquet
    from gem.data.format.reader import LoaderOptions
    from gem.data.pipeline.loader import build_loader
    from gem.data.sources.synthetic import generate

    table = generate(tiny_schema, 6, seed=0)
    table = table.set_column(table.schema.get_field_index("domain"), "domain", pa.array([0, 1, 7, 0, 0, 0], pa.int64()))
    write_parquet(table, tmp_path / "bad.parquet", tiny_schema)
    with pytest.raises(ValueError) as failure:
        list(build_loader([tmp_path / "bad.parquet"], tiny_schema, 3))
    fix = re.search(r"set (data\.loader\.on_error\.\w+=skip)", str(failure.value)).group(1)
    assert fix == "data.loader.on_error.domain_out_of_range=skip"
    extra = ["data.dir=/some/dataset"] if data == "parquet" else []
    config = validate(compose([f"data={data}", fix, *extra]))
    options = LoaderOptions.from_config(config.data.loader)
    policy = error_policy(options.on_error)
    assert policy["domain_out_of_range"] == "skip" and policy["id_out_of_range"] == "fail"
    loader = build_loader([tmp_path / "bad.parquet"], tiny_schema, 3, options=config.data.loader)
    assert sum(b.batch_size for b in loader) == 5 and loader.stats["skipped/domain_out_of_range"] == 1
    everything = validate(
        compose([f"data={data}", "data.loader.on_error.default=skip", "data.loader.window_batches=2", *extra])
    )
    assert set(error_policy(LoaderOptions.from_config(everything.data.loader).on_error).values()) == {"skip"}


@pytest.mark.parametrize(
    "model, override, match",
    [
        ("gem_tiny", "model.num_heads=0", "model.num_heads must be a positive integer, got 0"),
        ("gem_tiny", "model.head_dim=-16", "model.head_dim must be a positive integer, got -16"),
        ("gem_tiny", "model.head_dim=15", "model.head_dim must be even .* got 15; set model.head_dim=16"),
        ("gem_tiny", "model.dim=0", "model.dim must be a positive integer, got 0"),
        ("gem_tiny", "model.pffn_kv=0", "model.pffn_kv must be a positive integer, got 0"),
        ("gem_tiny", "model.num_layers=-1", "model.num_layers must be a non-negative integer, got -1"),
        ("gem_tiny", "model.window=-2", "model.window must be a non-negative integer or null, got -2"),
        ("gem_tiny", "model.top_mlp=[64,0]", r"model.top_mlp\[1\] must be a positive integer \(a layer width\), got 0"),
        ("gem_tiny", "model.wukong.num_experts=0", "model.wukong.num_experts must be a positive integer, got 0"),
        (
            "gem_tiny",
            "+model.streams.hist={num_heads:0}",
            "model.streams.hist.num_heads must be a positive integer, got 0",
        ),
        ("gem_tiny", "model.num_heads=two", "model.num_heads must be a positive integer, got 'two'"),
        ("dlrm", "model.dim=0", "model.dim must be a positive integer, got 0"),
        ("dlrm", "model.bottom_mlp=[-64]", r"model.bottom_mlp\[0\] must be a positive integer"),
        ("gem_seq", "model.num_heads=0", "model.num_heads must be a positive integer, got 0"),
        ("gem_seq", "model.temperature=0", "model.temperature must be a number > 0, got 0"),
        ("gem_seq", "model.dropout=1.0", r"model.dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_model_arguments_are_validated_with_their_full_key(model, override, match):
    """Issue #27.5: model.num_heads=0 failed inside the arch with "integer division or modulo by zero"."""
    with pytest.raises(ConfigError, match=match):
        validate(compose([f"model={model}", override]))


def test_valid_model_arguments_pass_and_the_arch_builds(tiny_schema):
    """Zero is a legal count where the archs build with it (no layers, no summary tokens, window 0)."""
    from hydra.utils import instantiate

    config = validate(
        compose(
            [
                "model=gem_tiny",
                "model.num_layers=0",
                "model.num_summary=0",
                "model.window=0",
                "model.wukong.num_lcb=0",
                "+model.streams.hist={num_heads:1,head_dim:32}",
            ]
        )
    )
    dims = {f: 8 for f in tiny_schema.id_feature_names} | {g.name: 8 for g in tiny_schema.sequence_groups}
    arch = instantiate(config.model, _partial_=True, _convert_="all")(schema=tiny_schema, feature_dims=dims)
    assert len(arch.layers) == 0


# Groups whose options change the schema's defaults (experiment/ and debug/ are presets over several
# groups; model/ holds a constructor's arguments, gem_arch.py and friends keep no config defaults).
SCHEMA_GROUPS = ("data", "optim", "parallelism", "plan", "sparse", "trainer", "kernels")


@pytest.mark.parametrize("group", SCHEMA_GROUPS)
def test_group_options_hold_only_what_they_change(group):
    """One source of defaults: gem/train/config.py's dataclasses. An option file that restated a
    default would be a second source, free to drift from the first."""
    from omegaconf import OmegaConf

    from gem.train.config import Config

    defaults = OmegaConf.to_container(OmegaConf.structured(Config))[group]

    def restated(node, default, path):
        for key, value in node.items():
            if key == "defaults" or key not in default:
                continue
            if isinstance(value, dict) and isinstance(default[key], dict) and value:
                yield from restated(value, default[key], f"{path}.{key}")
            elif value == default[key]:
                yield f"{path}.{key}"

    for option in sorted((Path(CONFIG_DIR) / group).glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(option))
        found = list(restated(node, defaults, group))
        assert not found, (
            f"{option.relative_to(CONFIG_DIR)} restates the schema's defaults of {found}; delete those lines"
        )
