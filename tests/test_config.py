from pathlib import Path

import pytest

from gem.train.config import ConfigError, validate
from tests.conftest import CONFIG_DIR, compose

GROUPS = sorted(p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir())


def test_every_group_is_documented_in_design():
    assert GROUPS == ["data", "debug", "experiment", "kernels", "model", "optim", "parallelism", "sparse", "trainer"]


@pytest.mark.parametrize("group, option", [(g, p.stem) for g in GROUPS for p in sorted((Path(CONFIG_DIR) / g).glob("*.yaml"))])
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
        ("sparse.backend=fbgemm", "sparse.backend='fbgemm' is not one of"),
        ("optim.dense.lr=-1", "optim.dense.lr=-1.0 must be > 0"),
        ("data.batch_size=0", "data.batch_size=0 must be > 0"),
        ("trainer.device=tpu", "trainer.device='tpu'"),
        ("sparse.sharding_type=diagonal", "sparse.sharding_type='diagonal'"),
        ("optim.schedule=linear", "optim.schedule"),
    ],
)
def test_bad_values_name_the_key(override, match):
    key = override.split("=")[0]
    cfg = compose([f"+{override}" if key == "trainer.devcie" else override])
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_parquet_needs_a_directory():
    with pytest.raises(ConfigError, match="data.dir is required"):
        validate(compose(["data=parquet", "data.dir=null"]))
