"""``trainer.best_metric``: test the weights of the best validation score, not the last step's.

Each validation (``trainer.eval_every``) that improves ``best_metric`` (``best_mode``: ``max`` or
``min``) writes the model's weights, tables and dense arch, with DCP to ``<run_dir>/best`` together
with ``best.json`` (the step, the metric and its value). The write is atomic: a ``.tmp-best`` folder
renamed into place by rank 0 once every rank's data is on disk. Before the final test evaluation the
trainer loads them back. A run resumed from a checkpoint keeps the best found before the restart; a
run that starts at step 0 removes an earlier run's. With ``best_patience`` the run stops once that
many validations in a row have not bettered it, checkpointed at that step (``checkpoint.enabled``),
so that a restart goes straight to the test. The optimizer state is not kept: these weights are
for testing and serving; training resumes from ``checkpoint.dir``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from gem.train.checkpoint import flatten_state, load_flat, sparse_module
from gem.train.config import ConfigError
from gem.train.logging import logger

RECORD = "best.json"


class BestWeights:
    """Keeps the weights of the best ``metric`` seen in validation under ``directory``.

    ``start_step`` is the step the run starts from (0 for a fresh run, which discards an earlier
    run's best weights; a resumed run reads them back with their score).
    """

    def __init__(self, metric: str, mode: str, directory: Path, model: nn.Module, start_step: int, rank: int = 0):
        self.metric, self.sign = metric, 1.0 if mode == "max" else -1.0
        self.dir, self.model, self.rank = Path(directory), model, rank
        self.step: int | None = None
        self.value: float | None = None
        record = self.dir / RECORD
        if start_step > 0 and record.is_file():
            saved = json.loads(record.read_text())
            if saved["metric"] == metric:
                self.step, self.value = saved["step"], saved["value"]
                logger.info(
                    "trainer.best_metric: kept %s = %.4f of step %d (%s)", metric, self.value, self.step, self.dir
                )
        elif start_step == 0 and rank == 0 and self.dir.exists():
            shutil.rmtree(self.dir)
        if rank == 0:
            shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def _tmp(self) -> Path:
        return self.dir.with_name(f".tmp-{self.dir.name}")

    def _state(self) -> dict:
        return {
            "model": {"sparse": sparse_module(self.model).state_dict(), "dense": self.model.dense_arch.state_dict()}
        }

    def update(self, step: int, values: dict[str, float]) -> None:
        """After a validation at ``step``: save the weights if ``values[metric]`` is the best so far."""
        if self.metric not in values:
            raise ConfigError(
                f"trainer.best_metric={self.metric!r}: validation does not log it; it logs {', '.join(sorted(values))}"
            )
        value = float(values[self.metric])
        improved = not math.isnan(value) and (self.value is None or self.sign * (value - self.value) > 0)
        if dist.is_initialized():  # every rank decides as rank 0 does: the save below is collective
            flag = [improved]
            dist.broadcast_object_list(flag, src=0)
            improved = flag[0]
        if not improved:
            return
        tmp = self._tmp
        tmp.mkdir(parents=True, exist_ok=True)
        dcp.save(flatten_state(self._state())[0], checkpoint_id=str(tmp))
        if self.rank == 0:  # DCP's save returns on rank 0 once every rank's files are written
            (tmp / RECORD).write_text(json.dumps({"metric": self.metric, "step": step, "value": value}))
            if self.dir.exists():
                shutil.rmtree(self.dir)
            os.replace(tmp, self.dir)
        if dist.is_initialized():
            dist.barrier()
        self.step, self.value = step, value
        logger.info(
            "trainer.best_metric: %s = %.4f at step %d, weights saved to %s", self.metric, value, step, self.dir
        )

    def patience_spent(self, step: int, eval_every: int, patience: int) -> bool:
        """Whether the validations after the best one, up to ``step`` (one every ``eval_every`` steps,
        so counted from the steps alone, the same after a restart), number ``patience`` or more."""
        return patience > 0 and self.step is not None and step // eval_every - self.step // eval_every >= patience

    def load(self) -> None:
        """Load the best weights into the model (a no-op before any validation saved them)."""
        if self.step is None:
            return
        state = self._state()
        load_flat(*flatten_state(state), self.dir)
        sparse_module(self.model).load_state_dict(state["model"]["sparse"])
        self.model.dense_arch.load_state_dict(state["model"]["dense"])
        logger.info(
            "trainer.best_metric: loaded the weights of step %d (%s = %.4f)", self.step, self.metric, self.value
        )
