"""The parts of a run that act at the Trainer's hook points, and the registry of outside ones.

A :class:`Component` overrides the hooks it needs; the Trainer calls them in the order of its
list: the built-in components below, then those a package registered (gem.train.registry), e.g.
gem.transfer's distillation, which gem.train never imports:

    build       dense_builder()            wrap the configured dense arch (before it is built)
    setup       setup(trainer)             the run built, before its checkpoint is restored
    start       start(trainer)             restored (trainer.step), before the first step
    loss        loss(trainer)              a loss function in place of the task loss (or None)
    each epoch  epoch_start(trainer)       before its first step
    each step   step_end(trainer)          after the step, before the checkpoint, logs, validation
    validation  validated(trainer, values) after each validation
    the end     fit_end(trainer)           training done: may set trainer.result (the final metrics)
    a signal    stopped(trainer)           SIGTERM / SIGINT: the run stops after this step, checkpointed
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from gem.data.pipeline.batch import Batch
from gem.train.best import BestWeights
from gem.train.config import Config, ConfigError
from gem.train.delta import build_exporter
from gem.train.evaluation import score_partition, stream_summary
from gem.train.logging import logger
from gem.train.profile import StepProfiler
from gem.train.registry import registered

StepHook = Callable[[int, int, Batch], None]  # (step, rank, the batch it trained on), after each training step


class Component:
    """A part of a run at the Trainer's hook points (module docstring); every hook is a no-op here."""

    def dense_builder(self):
        """A ``(schema, feature_dims, build) -> dense arch`` wrapper (gem.train.setup.DenseBuilder), or None."""
        return None

    def setup(self, trainer) -> None:
        pass

    def start(self, trainer) -> None:
        pass

    def loss(self, trainer):
        """``(logits, batch) -> (loss, per_task [K])`` in place of the task loss, or None."""
        return None

    def epoch_start(self, trainer) -> None:
        pass

    def step_end(self, trainer) -> None:
        pass

    def validated(self, trainer, values: dict[str, float]) -> None:
        pass

    def fit_end(self, trainer) -> None:
        pass

    def stopped(self, trainer) -> None:
        """The run stops on a signal after this step (gem.train.stopping), checkpointed."""
        pass


# config sections that outside components serve, and the package that registers each
_OUTSIDE = {"trainer.distill": "gem.transfer"}


def outside_components(config: Config) -> list[Component]:
    """The components that packages registered (gem.train.registry) and this run's config asks for;
    a section set without a registered component fails, naming the package to import."""
    d = config.trainer.distill
    wanted = {"trainer.distill": d.weight > 0 or d.representation > 0 or d.adapter}
    factories = registered()
    for section, package in _OUTSIDE.items():
        if wanted[section] and section not in factories:
            raise ConfigError(
                f"{section} is set, but no component serves it: import {package} before calling train() "
                f"(python -m gem.train and `import gem` do)"
            )
    components = []
    for path in factories.values():
        module, name = path.split(":")
        component = getattr(importlib.import_module(module), name)(config)
        if component is not None:
            components.append(component)
    return components


class StepHooks(Component):
    """The user's step hooks, ``hook(step, rank, batch)`` after each step (tests/faults.py)."""

    def __init__(self, hooks: Sequence[StepHook]) -> None:
        self.hooks = list(hooks)

    def step_end(self, trainer) -> None:
        for hook in self.hooks:
            hook(trainer.step, trainer.run.env.rank, trainer.train_step.last_batch)


class Profiling(Component):
    """``trainer.profile``: torch.profiler over a few steps, their device time by kind."""

    def start(self, trainer) -> None:
        run = trainer.run
        on_cuda = run.env.device.type == "cuda"
        self.profiler = StepProfiler(
            run.config.trainer.profile, run.run_dir / "profile", run.env.rank, trainer.step, on_cuda
        )

    def step_end(self, trainer) -> None:
        self.profiler.step()

    def stopped(self, trainer) -> None:
        self.profiler.close()

    def fit_end(self, trainer) -> None:
        self.profiler.close()
        result = self.profiler.result
        if result is not None:
            kinds = result["frac_of_busy_by_kind"]
            logger.info(
                "profile of steps %s: %.1f ms per step, idle %.0f%%; busy time %s (%s)",
                result["recorded_steps"],
                result["ms_per_step"],
                100 * result["idle_frac"],
                ", ".join(f"{k} {100 * v:.0f}%" for k, v in kinds.items() if v >= 0.005),
                trainer.run.run_dir / "profile",
            )


class DeltaExport(Component):
    """``trainer.delta_export``: the tables' changed rows (and the dense arch) as deltas after a
    base checkpoint, written after each step that ends a period, before that step's checkpoint (a
    restart from it never misses a delta)."""

    def start(self, trainer) -> None:
        run = trainer.run
        self.deltas = build_exporter(
            run.config,
            run.model,
            run.optimizers.dense,
            run.optimizers.sparse,
            run.run_dir,
            run.env.world_size,
            trainer.step,
            partitions=run.stream is not None,
        )
        if self.deltas is not None:
            self.deltas.start(trainer.checkpointer, trainer.progress)  # the chain's base: a checkpoint of this step

    def step_end(self, trainer) -> None:
        if self.deltas is None:
            return
        stream, loader = trainer.run.stream, trainer.run.train_loader
        done = stream is not None and sum(loader.consumed) == loader.steps_per_epoch
        self.deltas.maybe_export(trainer.step, trainer.total_steps, partition_done=stream.partition if done else None)

    def fit_end(self, trainer) -> None:
        if self.deltas is not None:
            self.deltas.close()

    stopped = fit_end


class KeepBest(Component):
    """``trainer.best_metric``: the weights of the best validation tested instead of the last
    step's; with ``best_patience`` the run stops after that many validations without a better one
    (gem/train/best.py)."""

    def start(self, trainer) -> None:
        run, t = trainer.run, trainer.run.config.trainer
        self.best = None
        if not t.best_metric:
            return
        self.best = BestWeights(t.best_metric, t.best_mode, run.run_dir / "best", run.model, trainer.step, run.env.rank)
        if self.best.patience_spent(trainer.step, run.plan.eval_every, t.best_patience):
            trainer.total_steps = trainer.step  # it had stopped early: straight to the test

    def validated(self, trainer, values: dict[str, float]) -> None:
        if self.best is None:
            return
        t = trainer.run.config.trainer
        self.best.update(trainer.step, values)
        if self.best.patience_spent(trainer.step, trainer.run.plan.eval_every, t.best_patience):
            logger.info(
                "trainer.best_patience: %d validations without a better %s than step %d's, stopping",
                t.best_patience,
                self.best.metric,
                self.best.step,
            )
            trainer.total_steps = trainer.step  # the loops end here
            if trainer.checkpointer is not None:  # a restart from it goes straight to the test
                trainer.checkpointer.save(trainer.position)

    def fit_end(self, trainer) -> None:
        if self.best is not None and self.best.step is not None and trainer.run.stream is None:
            self.best.load()
            trainer.result |= {"best_step": float(self.best.step), f"best_val/{self.best.metric}": self.best.value}


class StreamScoring(Component):
    """``data.kind=stream``: each partition scored before the model trains on it (progressive
    evaluation); the run's final metrics are the partitions' mean (``stream_metrics.json``)."""

    def __init__(self) -> None:
        self.scores: dict[str, dict[str, float]] = {}

    def epoch_start(self, trainer) -> None:
        run, stream = trainer.run, trainer.run.stream
        if stream is None or any(run.train_loader.consumed) or trainer.step >= trainer.total_steps:
            return
        trainer.train_step.detach()
        t = run.config.trainer
        loader = run.loader(stream.partition, run.config.data.eval_batch_size)
        scores = score_partition(
            run.model, loader, run.env, run.source.schema.tasks, stream.partition, t.eval_max_batches, trainer.autocast
        )
        self.scores[stream.partition] = scores
        trainer.metrics.write(
            "stream", trainer.step, {"partition": stream.partition, "partition_index": trainer.epoch, **scores}
        )

    def fit_end(self, trainer) -> None:
        run = trainer.run
        if run.stream is not None:
            trainer.result = stream_summary(run.run_dir, self.scores) if run.env.is_main else {}


def builtin_components(hooks: Sequence[StepHook] = ()) -> list[Component]:
    """gem.train's own components, in the order their hooks run."""
    return [StepHooks(hooks), Profiling(), DeltaExport(), KeepBest(), StreamScoring()]
