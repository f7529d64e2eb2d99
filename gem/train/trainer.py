"""``train(cfg)``: set the run up (gem.train.setup), then a :class:`Trainer` runs its short loop with
its components (gem.train.components) at named hook points.

    train(cfg)
      validate -> [pretraining stage: fit] -> fit
    fit(config)
      logging, environment, components, setup.build -> Trainer(run, components).fit()
    Trainer.fit()
      each epoch:  components' epoch_start, then each step: train_step, components' step_end,
                   checkpoint, log window, validation (components' validated)
      the end:     components' fit_end, the test (unless a component set the result), test_metrics.json
"""

from __future__ import annotations

import importlib
import itertools
import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from gem.train import pretrain, rundir
from gem.train.checkpoint import Checkpointer, Progress
from gem.train.components import Component, StepHook, builtin_components, outside_components
from gem.train.config import Config, validate
from gem.train.evaluation import evaluate
from gem.train.flops import default_peak_tflops, step_flops
from gem.train.logging import LogWindow, format_metrics, log_fallbacks, logger, open_metrics, plot_curves, setup_logging
from gem.train.losses import multitask_bce
from gem.train.metrics import id_mapping_counts
from gem.train.setup import Run, build, environment
from gem.train.startup import (
    StartupTimer,
    compile_breakdown,
    compile_counters,
    count_finished_run,
    log_startup,
    start_compile_workers,
)
from gem.train.step import TimedIterator, TrainStep
from gem.train.stopping import Preempted, StopSignals
from kernels import fallback as kernel_fallback

__all__ = ["StepHook", "Trainer", "evaluate", "fit", "train"]

# names this module defined before gem.train.setup and gem.train.evaluation: (new module, new name)
_MOVED = {
    "DistEnv": ("gem.train.setup", "DistEnv"),
    "init_distributed": ("gem.train.setup", "init_distributed"),
    "seed_everything": ("gem.train.setup", "seed_everything"),
    "load_data": ("gem.train.setup", "load_data"),
    "parallel_dims": ("gem.train.setup", "parallel_dims"),
    "build_model": ("gem.train.setup", "build_model"),
    "split_loader": ("gem.train.setup", "split_loader"),
    "apply_transfer": ("gem.train.setup", "initialize"),
    "score_partition": ("gem.train.evaluation", "score_partition"),
    "stream_summary": ("gem.train.evaluation", "stream_summary"),
}
# names whose functions were folded into others: what does their work now
_FOLDED = {
    "check_eval_splits": "gem.train.setup.plan (its eval_rows argument), which gem.train.setup.build calls",
    "distill_loss": "gem.transfer.components.Distillation.loss (the trainer.distill component)",
    "pretrain_stage": "gem.train.pretrain.stage_and_run (the stage's config and the run's; train() fits both)",
}


def __getattr__(name: str):
    if name in _MOVED:
        module, new = _MOVED[name]
        warnings.warn(
            f"gem.train.trainer.{name} is deprecated: use `from {module} import {new}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), new)
    if name in _FOLDED:
        raise AttributeError(f"gem.train.trainer.{name} was removed: its work is done by {_FOLDED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train(cfg: DictConfig | dict, hooks: Sequence[StepHook] = ()) -> dict[str, float]:
    """Train and evaluate as configured; returns the final test metrics.

    ``cfg`` is the composed Hydra config (configs/train.yaml) or an equivalent dict. Each of
    ``hooks`` is called after every training step as ``hook(step, rank, batch)`` with the batch that
    step trained on (tests use them to log examples or to kill a rank; see tests/faults.py).
    With ``trainer.pretrain`` a pretraining stage trains first and the run starts from it.
    """
    timer = StartupTimer()
    config = validate(cfg)
    if config.trainer.pretrain:
        stage, cfg = pretrain.stage_and_run(cfg, config)
        logger.info("trainer.pretrain: %s, in %s", " ".join(config.trainer.pretrain), stage.trainer.run_dir)
        fit(validate(stage))
        timer = StartupTimer()
        config = validate(cfg)
    return fit(config, hooks, timer)


def fit(config: Config, hooks: Sequence[StepHook] = (), timer: StartupTimer | None = None) -> dict[str, float]:
    """One run of a validated config: its folder and log, the environment, the components, the
    parts (gem.train.setup.build), then the Trainer's loop; returns the final metrics."""
    timer = timer or StartupTimer()
    if config.parallelism.compile:
        start_compile_workers()
    run_dir = Path(config.trainer.run_dir)
    env = environment(config, timer)
    with rundir.hold(run_dir, env.rank, env.world_size) as took_over, StopSignals(env.world_size) as stop:
        if env.is_main:
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))
        setup_logging(run_dir if env.is_main else None, env.rank)
        if took_over:
            logger.warning(took_over)
        components = [*builtin_components(hooks), *outside_components(config)]
        run = build(config, env, run_dir, timer, [b for c in components if (b := c.dense_builder()) is not None])
        return Trainer(run, components, stop).fit()


class Trainer:
    """The loop of one run over the parts ``setup.build`` made, with ``components`` at its hook
    points (gem.train.components). State the components read: ``run``, ``step``, ``epoch``,
    ``total_steps`` (a component may lower it to stop the run), ``progress`` (where the run
    started), ``position`` (where it is, as a checkpoint records it), ``checkpointer``,
    ``metrics``, ``train_step``, ``autocast``, ``result`` (the final metrics)."""

    def __init__(self, run: Run, components: Sequence[Component], stop: StopSignals | None = None) -> None:
        self.run, self.components, self.stop = run, list(components), stop
        config, env, t = run.config, run.env, run.config.trainer
        self.start = run.timer.start
        self.total_steps = run.plan.total_steps
        self.epoch, self.result = 0, {}
        for component in self.components:
            component.setup(self)
        self.progress, self.checkpointer = Progress(), None
        if config.checkpoint.enabled:
            with run.timer.phase("checkpoint load"):
                o = run.optimizers
                self.checkpointer = Checkpointer(
                    config.checkpoint,
                    run.checkpoint_dir,
                    run.model,
                    o.dense,
                    o.sparse,
                    o.schedule,
                    OmegaConf.to_yaml(OmegaConf.structured(config)),
                    env.rank,
                    env.world_size,
                    loader=run.train_loader,
                )
                self.progress = self.checkpointer.restore() or self.progress
        if run.stream is not None:
            run.stream.check_resume()  # a partition dated before the checkpoint's appeared: stop, naming it
        self.step, self.position = self.progress.step, self.progress
        for component in self.components:
            component.start(self)
        self.metrics = open_metrics(run.run_dir, t.loggers, env.is_main, self.step)
        self.autocast = getattr(torch, t.autocast) if t.autocast else None  # validated: "bfloat16"
        weights = [t.task_weights.get(k, 1.0) for k in run.source.schema.tasks]  # 1 where unset
        self.task_weights = torch.tensor(weights, device=env.device)
        fused = run.optimizers.fused  # present when TorchRec sharded the tables
        num_dense = sum(p.numel() for n, p in run.model.named_parameters() if not n.startswith("sparse_arch."))
        logger.info(
            "model: %s, %.2fM dense parameters; sparse backend %s, %d tables with the fused optimizer; %d steps",
            config.model["_target_"],
            num_dense / 1e6,
            config.sparse.backend,
            len(fused.params) if fused is not None else 0,
            self.total_steps,
        )
        loss = self._loss()
        self.train_step = TrainStep(run.model, loss, run.optimizers.set, env.device, self._pipelined(), self.autocast)
        self.peak_tflops = t.peak_tflops if t.peak_tflops is not None else default_peak_tflops(env.device)
        self.fallbacks = len(kernel_fallback.events())  # reported so far (the list is the process's)

    def _loss(self):
        """``(logits, batch) -> (loss, per_task)``: the arch's own objective, a component's
        (distillation), or the masked multi-task BCE weighted by ``trainer.task_weights``."""
        run = self.run
        tasks = run.source.schema.tasks
        if run.model.capabilities.returns_loss:  # e.g. gem.models.generative: its own objective
            return lambda loss, b: (loss.sum(), loss.detach().reshape(1).expand(len(tasks)))
        for component in self.components:
            loss = component.loss(self)
            if loss is not None:
                return loss
        weights, group = self.task_weights, dist.group.WORLD if run.env.world_size > 1 else None
        return lambda logits, b: multitask_bce(logits, b.labels, b.label_mask, weights, b.weights, group=group)

    def _pipelined(self) -> bool:
        """Whether TorchRec's sparse-dist pipeline runs the steps (logged either way)."""
        run = self.run
        fused = run.optimizers.fused  # present when TorchRec sharded the tables
        want = run.config.sparse.pipeline if run.config.sparse.pipeline is not None else run.env.device.type == "cuda"
        shared = bool(getattr(run.model.sparse_arch, "module", run.model.sparse_arch).routed_id_features)
        pipelined = want and fused is not None and not shared
        reason = "needs TorchRec-sharded tables" if fused is None else "an id feature shares a sequence table"
        logger.info(
            "sparse-dist training pipeline (input all-to-all of batch i+1 overlaps dense compute of batch i): %s",
            "active" if pipelined else f"off ({reason})" if want else "off",
        )
        return pipelined

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``, then the final metrics (components' fit_end, the test)."""
        run = self.run
        self.window = LogWindow(self.peak_tflops, run.env.device.type == "cuda")
        show = run.config.trainer.progress_bar and run.env.is_main
        self.bar = tqdm(total=self.total_steps, initial=self.step, disable=not show, desc="train", dynamic_ncols=True)
        for epoch in range(self.progress.epoch, run.plan.epochs):
            self.epoch, loader = epoch, run.train_loader
            loader.set_epoch(self.epoch)  # keeps a restored position in the epoch we resume in
            steps_left = loader.steps_per_epoch - sum(loader.consumed)  # a stream's partitions differ
            for component in self.components:
                component.epoch_start(self)
            count_flops = lambda b: step_flops(run.model.dense_arch, b, run.source.schema)  # noqa: E731
            batches = TimedIterator(itertools.islice(iter(loader), steps_left), count_flops)
            for _ in range(steps_left):
                if self.step >= self.total_steps:
                    break
                self.train_one(batches)
            if self.step >= self.total_steps:
                break
        return self.finish()

    def train_one(self, batches: TimedIterator) -> None:
        """One training step and what follows it: the components' step_end, the checkpoint, the
        log window, the validation, a stop signal."""
        run, t = self.run, self.run.config.trainer
        first = self.step == self.progress.step
        compile_before = compile_counters() if first else {}
        tick, waited, flops = time.perf_counter(), batches.waited, batches.flops
        per_task, batch_size = self.train_step(batches)
        run.optimizers.schedule.step()
        self.step += 1
        if first:
            run.timer.phases["first batch"] = batches.waited - waited
            run.timer.compile = compile_breakdown(compile_before, compile_counters())
            seconds = time.perf_counter() - tick - (batches.waited - waited)
            log_startup(run.timer, seconds, self.metrics, run.run_dir, run.env.local_rank, run.env.is_main)
            self.fallbacks = log_fallbacks(self.metrics, self.step, self.fallbacks)
        for component in self.components:
            component.step_end(self)
        if self.checkpointer is not None:
            batch = run.config.data.batch_size * run.env.world_size
            seen = self.progress.examples + (self.step - self.progress.step) * batch
            self.position = Progress(self.step, self.epoch, sum(run.train_loader.consumed) * batch, seen)
            self.checkpointer.maybe_save(self.position, self.total_steps)
        self.bar.update()
        flops = None if None in (flops, batches.flops) else batches.flops - flops
        self.window.add(
            (per_task * self.task_weights).sum(),
            per_task,
            batch_size * run.env.world_size,
            batches.waited - waited,
            flops,
        )
        if self.step % t.log_every == 0 or self.step == self.total_steps:
            self.log()
        if run.plan.eval_every and (self.step % run.plan.eval_every == 0 or self.step == self.total_steps):
            self.validate()
        signum = self.stop.requested() if self.stop is not None else None
        if signum:
            self.preempt(signum)

    def log(self) -> None:
        """The log window's line: losses, throughput, MFU, the learning rate, data and id counts."""
        run = self.run
        values = self.window.summary(run.source.schema.tasks, self.step)
        values |= {"lr": run.optimizers.lr, "epoch": self.epoch}
        values |= {f"data/{k}": v for k, v in run.train_loader.stats.items() if k.startswith(("skipped", "trunc"))}
        values |= id_mapping_counts(run.model.sparse_arch)  # sparse.ids: collisions, evictions per table
        self.bar.set_postfix(loss=f"{values['loss']:.4f}")
        logger.info("step %d %s", self.step, format_metrics(values))
        self.metrics.write("train", self.step, values)
        self.fallbacks = log_fallbacks(self.metrics, self.step, self.fallbacks)
        self.window = LogWindow(self.peak_tflops, run.env.device.type == "cuda")

    def validate(self) -> None:
        """Evaluate on the validation split (its time left out of the throughput); then the
        components' validated."""
        run, t = self.run, self.run.config.trainer
        eval_start = time.perf_counter()
        self.train_step.detach()
        loader = run.loader("val", run.config.data.eval_batch_size)
        values = evaluate(run.model, loader, run.env, run.source.schema.tasks, t.eval_max_batches, self.autocast)
        logger.info("val step %d %s", self.step, format_metrics(values))
        self.metrics.write("val", self.step, values)
        for component in self.components:
            component.validated(self, values)
        self.window.start += time.perf_counter() - eval_start  # throughput counts training time only

    def preempt(self, signum: int) -> None:
        """A stop signal after this step: log and checkpoint it, close the components, raise Preempted."""
        if self.window.steps:
            self.log()
        self.train_step.detach()
        self.bar.close()
        where = None
        if self.checkpointer is not None:
            self.checkpointer.save(self.position)
            self.checkpointer.wait()
            where = str(self.run.checkpoint_dir / f"step_{self.step:09d}")
        for component in self.components:
            component.stopped(self)
        self.metrics.close()
        raise Preempted(signum, self.step, where)

    def finish(self) -> dict[str, float]:
        """The components' fit_end, the test evaluation (unless one of them set the result), the
        final metrics written (metrics.jsonl, test_metrics.json) and returned."""
        run, t = self.run, self.run.config.trainer
        self.train_step.detach()
        self.bar.close()
        if self.checkpointer is not None:
            self.checkpointer.wait()
        for component in self.components:
            component.fit_end(self)
        if run.stream is None and t.test:
            test = run.loader("test", run.config.data.eval_batch_size)
            self.result |= evaluate(
                run.model, test, run.env, run.source.schema.tasks, t.eval_max_batches, self.autocast
            )
        result = self.result | {"train_seconds": time.perf_counter() - self.start, "steps": self.step}
        log_fallbacks(self.metrics, self.step, self.fallbacks)
        self.metrics.write("test", self.step, result)
        self.metrics.close()
        if run.env.is_main:
            (run.run_dir / "test_metrics.json").write_text(json.dumps(result, indent=2))
        ended = "test" if t.test or run.stream is not None else "end of training:"
        logger.info("%s %s", ended, format_metrics(result))
        if run.env.is_main and t.plots:
            plot_curves(run.run_dir)
        count_finished_run(time.perf_counter() - self.start)
        return result
