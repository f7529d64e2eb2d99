"""gem.transfer's component of a training run (gem.train.components): ``trainer.distill``.

Registered by ``gem/transfer/__init__.py`` (gem.train.registry), which ``python -m gem.train`` and
the ``gem`` API import; gem.train never imports gem.transfer. It wraps the student's dense arch (``representation``,
``adapter``: gem.transfer.student), checks or attaches the teacher before training, and trains on
the true labels mixed with the teacher's logits (``weight``).
"""

from __future__ import annotations

import torch.distributed as dist

from gem.train.components import Component
from gem.train.config import Config, ConfigError
from gem.train.logging import logger
from gem.train.losses import multitask_bce
from gem.transfer.student import prepare_teacher, uses_teacher, wrap_dense


class Distillation(Component):
    """``trainer.distill``: a student of a teacher's outputs (docs/transfer.md)."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def dense_builder(self):
        dd = self.config.trainer.distill
        if not (dd.representation > 0 or dd.adapter):
            return None
        return lambda schema, feature_dims, build: wrap_dense(self.config, schema, feature_dims, build)

    def setup(self, trainer) -> None:
        """The teacher's outputs are there (``source=data``: the data's columns) or will be
        (``source=model``: an online teacher filling each batch)."""
        run = trainer.run
        prepare_teacher(run.config, run.source.schema, run.model, run.env.device, run.source.files)

    def loss(self, trainer):
        """With ``weight > 0``: true labels mixed with the teacher's logits, ``batch.teacher``."""
        dd, tasks = self.config.trainer.distill, trainer.run.source.schema.tasks
        if dd.weight <= 0:
            return None
        chosen = list(dd.tasks) or list(tasks)
        unknown = [k for k in chosen if k not in tasks]
        if unknown:
            raise ConfigError(f"trainer.distill.tasks: {unknown} are not tasks of the data ({list(tasks)})")
        weights = [dd.weight if k in chosen else 0.0 for k in tasks]
        distill_weight = trainer.task_weights.new_tensor(weights)
        group = dist.group.WORLD if trainer.run.env.world_size > 1 else None
        logger.info(
            "trainer.distill: weight %g, temperature %g, tasks %s, teacher outputs from %s",
            dd.weight,
            dd.temperature,
            chosen,
            dd.source,
        )
        task_weights = trainer.task_weights
        return lambda logits, b: multitask_bce(
            logits,
            b.labels,
            b.label_mask,
            task_weights,
            b.weights,
            group=group,
            teacher=b.teacher,
            distill_weight=distill_weight,
            temperature=dd.temperature,
        )


def distillation(config: Config) -> Distillation | None:
    """The run's Distillation component, where ``trainer.distill`` asks for a teacher."""
    return Distillation(config) if uses_teacher(config) else None
