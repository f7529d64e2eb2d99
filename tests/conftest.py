"""Shared fixtures: a tiny schema, a tiny synthetic data set, Hydra composition, GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in its interpreter. The variable is read when triton is first
# imported, which importing gem (and kernels) does, so it is set here, before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gem.data.pipeline.schema import FeatureSchema  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(ROOT / "configs")

TINY_SCHEMA = {
    "id_features": [
        {"name": "user_id", "cardinality": 50},
        {"name": "ad_id", "cardinality": 80},
        {"name": "ad_cluster", "cardinality": 5},
        {"name": "user_interests", "cardinality": 5, "max_ids": 3},
    ],
    "sequence_groups": [
        {
            "name": "hist",
            "max_len": 12,
            "features": [
                {"name": "hist_item", "cardinality": 80},
                {"name": "hist_action", "cardinality": 4},
                {"name": "hist_surface", "cardinality": 2},
                {"name": "hist_gap", "cardinality": 6},
            ],
        }
    ],
    "num_dense": 3,
    "tasks": ["click", "conversion"],
    "num_domains": 2,
}


def fbgemm_cuda() -> bool:
    """Whether the CUDA build of fbgemm-gpu (TorchRec's sharded GPU kernels) is installed and a GPU seen."""
    try:
        import fbgemm_gpu
    except Exception:
        return False
    return torch.cuda.is_available() and getattr(fbgemm_gpu, "__variant__", "cpu") == "cuda"


# TorchRec-sharded tables on a GPU (FBGEMM's fused kernels): skipped elsewhere
needs_fbgemm_cuda = pytest.mark.skipif(not fbgemm_cuda(), reason="needs a CUDA GPU and the CUDA fbgemm-gpu build")


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture
def tiny_schema() -> FeatureSchema:
    return FeatureSchema.from_config(TINY_SCHEMA)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    from gem.data.sources.synthetic import SyntheticConfig, write_dataset

    directory = tmp_path_factory.mktemp("data") / "tiny"
    write_dataset(
        directory,
        FeatureSchema.from_config(TINY_SCHEMA),
        {"train": 700, "val": 150, "test": 300},
        seed=3,
        cfg=SyntheticConfig(num_clusters=5),
        rows_per_file=300,
    )
    return directory


def compose(overrides: list[str]):
    """Compose configs/train.yaml as `python -m gem.train` would, with ``overrides``."""
    from gem.train.api import compose as api_compose

    return api_compose(overrides)


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group (FSDP2 on a 1-rank mesh) for the test's duration."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _drop_process_group_created_during():
    """train() leaves its process group up (``python -m gem.train`` tears it down); a test or a
    module's fixture that trains in-process with sharded tables would hand it on, and the next
    group then fails to start. A group that existed before is left alone."""
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        dist.destroy_process_group()


drop_after_each_test = pytest.fixture(autouse=True)(_drop_process_group_created_during)
drop_after_each_module = pytest.fixture(autouse=True, scope="module")(_drop_process_group_created_during)
