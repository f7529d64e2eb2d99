"""The library API: compose a config, build its parts, and write your own training loop.

``train(cfg)`` (gem.train.trainer) is the whole run; these functions hand out the same parts it
builds, so a custom loop trains the same model on the same data::

    import gem

    cfg = gem.compose(["debug=tiny", "model=gem_tiny"])      # Hydra overrides, as on the command line
    data = gem.build_data(cfg)                               # typed config, device, schema, data set
    model = gem.build_model(data)                            # sparse tables + dense arch, on data.device
    opt = gem.build_optimizers(model, data, total_steps=100) # AdamW, table Adagrad, LR schedule
    for step, batch in zip(range(100), data.loader("train")):
        batch = batch.to(data.device)
        opt.zero_grad()
        loss, per_task = data.loss(model(batch), batch)
        loss.backward()
        opt.step()                                           # every optimizer, then the schedule
    print(gem.evaluate(model, data, "val"))                  # {"click/auc": ..., "click/ne": ...}

The runnable version is ``examples/custom_loop.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily: `import gem` stays cheap
    import torch
    from omegaconf import DictConfig
    from torch import nn

    from gem.data.pipeline.loader import BatchLoader
    from gem.data.pipeline.schema import FeatureSchema
    from gem.data.sources import DataSource
    from gem.train.config import Config
    from gem.train.setup import DistEnv, Optimizers

__all__ = ["Data", "Optimizers", "build_data", "build_model", "build_optimizers", "compose", "config_dir", "evaluate"]


def config_dir() -> str:
    """The folder of the Hydra config tree (``train.yaml`` and its groups).

    An installed wheel ships it as ``gem/configs``; a source checkout keeps it at the top level
    (``configs/``, next to ``gem/``).
    """
    package = Path(__file__).resolve().parents[1]  # gem/
    for candidate in (package / "configs", package.parent / "configs"):
        if (candidate / "train.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"gem's Hydra configs are missing: neither {package / 'configs'} nor "
        f"{package.parent / 'configs'} holds train.yaml; reinstall gem"
    )


def compose(overrides: Sequence[str] = (), config_name: str = "train") -> DictConfig:
    """The config ``python -m gem.train <overrides>`` would run, e.g. ``compose(["model=gem_tiny",
    "trainer.max_steps=10"])``. Works from any directory (the config tree ships with gem)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import gem.train.config  # noqa: F401  (registers the schema the config tree starts from)

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))


@dataclass
class Data:
    """What :func:`build_data` prepared: the typed config, the process's device and rank, and the
    data source (:func:`gem.data.build_source`: the feature schema and the data set folder with
    ``train/``, ``val/``, ``test/``)."""

    config: Config
    env: DistEnv
    source: DataSource
    task_weights: torch.Tensor = field(repr=False, default=None)

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def schema(self) -> FeatureSchema:
        return self.source.schema

    @property
    def dir(self) -> Path:
        return self.source.dir

    def loader(self, split: str = "train", batch_size: int | None = None) -> BatchLoader:
        """This rank's loader over ``split`` as the trainer builds it (``train``: shuffled, balanced,
        whole batches of ``data.batch_size``; ``val`` / ``test``: in order, ``data.eval_batch_size``).
        Iterating it yields one epoch of :class:`gem.data.Batch` on the host."""
        from gem.train.setup import split_loader

        return split_loader(self.config, self.env, self.source, split, batch_size)

    def loss(self, logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, per_task [K])``: the trainer's masked multi-task binary cross-entropy, weighted by
        ``trainer.task_weights`` (normalized over the global batch when there are several ranks)."""
        import torch.distributed as dist

        from gem.train.losses import multitask_bce

        group = dist.group.WORLD if self.env.world_size > 1 else None
        return multitask_bce(
            logits.float(), batch.labels, batch.label_mask, self.task_weights, batch.weights, group=group
        )


def build_data(cfg: DictConfig | dict | Config) -> Data:
    """Validate ``cfg`` (a :class:`gem.train.config.ConfigError` names a bad key), pick the device,
    start a process group when TorchRec sharding or torchrun needs one, seed every generator
    (``trainer.seed``), and prepare the data set (generating the synthetic one into
    ``data.cache_dir`` on first use): the first two stages of the trainer's set-up
    (gem.train.setup)."""
    import torch

    from gem.train import setup
    from gem.train.config import Config, validate
    from gem.train.logging import logger

    config = cfg if isinstance(cfg, Config) else validate(cfg)
    env = setup.environment(config)
    logger.info(env.threads)
    source = setup.data(config, env)
    weights = torch.tensor([config.trainer.task_weights.get(k, 1.0) for k in source.schema.tasks], device=env.device)
    return Data(config, env, source, weights)


def build_model(data: Data) -> nn.Module:
    """The :class:`gem.models.gem.GEMModel` the config describes (TorchRec-sharded tables with their
    fused optimizer, or plain ones; FSDP2 on the dense arch with several ranks), on ``data.device``,
    its dense arch wrapped as the registered components ask (gem.transfer's students; at most one
    may), its parameters loaded from ``checkpoint.init_from`` and frozen by ``checkpoint.init_frozen``
    as the trainer's set-up does (gem.train.setup.build)."""
    from gem.train.components import outside_components
    from gem.train.setup import build_model as _build_model
    from gem.train.setup import checkpoint_dir, initialize, one_dense_builder

    config = data.config
    builder = one_dense_builder([b for c in outside_components(config) if (b := c.dense_builder()) is not None])
    model = _build_model(config, data.schema, data.env, source=data.source, dense_builder=builder)
    initialize(config, model, checkpoint_dir(config))
    return model


def build_optimizers(model: nn.Module, data: Data, total_steps: int) -> Optimizers:
    """The trainer's optimizers for ``model`` (``optim.*``); ``total_steps`` sets the cosine schedule's length."""
    from gem.train.setup import Optimizers

    return Optimizers(model, data.config, total_steps)


def evaluate(model: nn.Module, data: Data, split: str = "val", max_batches: int = -1) -> dict[str, Any]:
    """Per-task AUC / NE / count over ``split`` (and HR / NDCG / MRR when it has candidate groups),
    gathered over every rank; the model goes back to training mode afterwards."""
    import torch

    from gem.train.evaluation import evaluate as _evaluate

    t = data.config.trainer
    return _evaluate(
        model,
        data.loader(split),
        data.env,
        data.schema.tasks,
        max_batches,
        getattr(torch, t.autocast) if t.autocast else None,
    )


def __getattr__(name):
    if name == "Optimizers":  # (defined here before gem.train.setup)
        from gem.train.setup import Optimizers

        return Optimizers
    raise AttributeError(f"module 'gem.train.api' has no attribute {name!r}")
