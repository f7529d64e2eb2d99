"""Console and JSON-lines logging for rank 0."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gem.train.flops import mfu
from kernels import fallback as kernel_fallback

logger = logging.getLogger("gem")


class _TqdmHandler(logging.StreamHandler):
    """Prints log lines above an active progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(run_dir: Path | None, rank: int) -> None:
    # Hydra sets the root logger to INFO, which lets TorchRec / FBGEMM print pages of set-up detail.
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # a deprecation note per KJT trace
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(message)s", datefmt="%H:%M:%S")
    handler = _TqdmHandler()
    handler.setFormatter(fmt)
    logger.addHandler(handler)
    if run_dir is not None and rank == 0:
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(fmt)
        logger.addHandler(file)


class MetricsWriter:
    """Appends one JSON object per line to ``<run_dir>/metrics.jsonl`` (rank 0 only), and with
    ``tensorboard_dir`` also writes every numeric value as a TensorBoard scalar ``<kind>/<key>``.

    A resumed run (``append``) first drops the rows that it will write again: training and
    validation rows after ``resume_step`` (written after the checkpoint it resumed from, e.g.
    while an asynchronous save was still in flight when the process died), a test row at or after
    it, and a line cut short by the kill. TensorBoard's events from ``resume_step + 1`` on are
    purged the same way (``SummaryWriter(purge_step=...)``).
    """

    def __init__(
        self, path: Path | None, append: bool = False, resume_step: int = 0, tensorboard_dir: Path | None = None
    ) -> None:
        self.path = path
        if path is not None and not append:
            path.write_text("")
        elif path is not None and path.exists():
            self._drop_rolled_back(path, resume_step)
        self.tensorboard = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # checked at validation: the package is there

            self.tensorboard = SummaryWriter(str(tensorboard_dir), purge_step=resume_step + 1 if append else None)

    @staticmethod
    def _drop_rolled_back(path: Path, resume_step: int) -> None:
        kept, dropped = [], 0
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                step, kind = row["step"], row["kind"]
            except (ValueError, KeyError, TypeError):
                dropped += 1  # cut short by the kill
                continue
            # a stream's partition is scored at the step before its first batch, so again on a resume there
            if (kind in ("train", "val") and step > resume_step) or (
                kind in ("test", "stream") and step >= resume_step
            ):
                dropped += 1
            else:
                kept.append(line + "\n")
        if dropped:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)
            logger.info(
                "%s: dropped %d rows after step %d (the run resumed from there)", path.name, dropped, resume_step
            )

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if self.tensorboard is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tensorboard.add_scalar(f"{kind}/{k}", v, step)
        if self.path is None:
            return
        row = {"kind": kind, "step": step, "time": time.time(), **{k: _clean(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def open_metrics(run_dir: Path, loggers: list[str], is_main: bool, resume_step: int) -> MetricsWriter:
    """The metrics writer of ``trainer.loggers`` (``jsonl``: metrics.jsonl; ``tensorboard``: events
    under ``<run_dir>/tensorboard``); writes nothing on ranks other than 0."""
    return MetricsWriter(
        run_dir / "metrics.jsonl" if is_main and "jsonl" in loggers else None,
        append=resume_step > 0,
        resume_step=resume_step,
        tensorboard_dir=run_dir / "tensorboard" if is_main and "tensorboard" in loggers else None,
    )


def plot_curves(run_dir: Path) -> Path | None:
    """Training loss (total and per task) and the validation metrics per step from
    ``<run_dir>/metrics.jsonl`` into ``<run_dir>/curves.png``; the test metrics in the title.
    Skipped, with one log line, without matplotlib (``pip install matplotlib``) or metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.info("curves: matplotlib is not installed, no curves.png (pip install matplotlib)")
        return None
    if not path.is_file():
        logger.info("curves: no %s (trainer.loggers has no jsonl), no curves.png", path)
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    test = next((r for r in reversed(rows) if r["kind"] == "test"), None)
    metric_keys = sorted({k for r in val for k in r if k.endswith(("/auc", "/ne", "/hr@10", "/ndcg@10"))})
    fig = Figure(figsize=(11 if metric_keys else 6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if metric_keys else 1, squeeze=False)[0]
    loss_keys = ["loss"] + sorted({k for r in train for k in r if k.endswith("/loss")})
    for key in loss_keys:
        points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if points:
            axes[0].plot(*zip(*points), label=key, linewidth=2 if key == "loss" else 1)
    axes[0].set(xlabel="step", ylabel="training loss (log window mean)", title="training loss")
    axes[0].legend(fontsize=8)
    if metric_keys:
        for key in metric_keys:
            points = [(r["step"], r[key]) for r in val if r.get(key) is not None]
            if points:
                axes[1].plot(*zip(*points), marker="o", label=key)
        axes[1].set(xlabel="step", title="validation")
        axes[1].legend(fontsize=8)
    if test is not None:
        summary = ", ".join(
            f"{k} {test[k]:.4f}"
            for k in sorted(test)
            if k.endswith(("/auc", "/ne", "/hr@10")) and isinstance(test[k], float)
        )
        fig.suptitle(f"{run_dir.name}: test {summary}" if summary else run_dir.name, fontsize=9)
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    logger.info("curves: %s", out)
    return out


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN
    return v


def format_metrics(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


class LogWindow:
    """Sums between two log lines, kept on the device so that a step never waits for the GPU;
    ``summary()`` synchronizes once and measures wall time since the window opened."""

    def __init__(self, peak_tflops: float | None = None, cuda: bool = False) -> None:
        self.start = time.perf_counter()
        self.cuda = cuda  # also log the peak device memory
        self.steps, self.examples, self.waited = 0, 0, 0.0
        self.flops: int | None = 0  # this rank's analytic FLOPs (None: the dense arch cannot count them)
        self.peak_tflops = peak_tflops
        self.loss: torch.Tensor | None = None
        self.per_task: torch.Tensor | None = None

    def add(
        self, loss: torch.Tensor, per_task: torch.Tensor, examples: int, waited: float, flops: int | None = None
    ) -> None:
        self.steps += 1
        self.flops = None if flops is None or self.flops is None else self.flops + flops
        self.examples += examples
        self.waited += waited
        self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
        self.per_task = per_task if self.per_task is None else self.per_task + per_task

    def summary(self, tasks: tuple[str, ...], step: int) -> dict[str, float]:
        loss = self.loss.item() / self.steps
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"steps {step - self.steps + 1}..{step}: mean loss is {loss}; lower optim.dense.lr "
                "or set optim.grad_clip"
            )
        seconds = time.perf_counter() - self.start
        out = {"loss": loss}
        out |= {f"{k}/loss": v / self.steps for k, v in zip(tasks, self.per_task.tolist())}
        out |= {
            "examples_per_s": self.examples / seconds,
            "step_ms": 1000 * seconds / self.steps,
            "data_wait_frac": min(1.0, self.waited / seconds),
        }
        if self.flops is not None:  # per rank: TFLOP/s on the true jagged lengths, MFU against the peak
            out |= {"tflops": self.flops / seconds / 1e12, "mfu": mfu(self.flops, seconds, self.peak_tflops)}
        if self.cuda:  # this rank's, since the start
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out


def log_fallbacks(metrics: MetricsWriter, step: int, reported: int) -> int:
    """A ``fallback`` row in the metrics for each kernel fallback after the first ``reported``
    (kernels.fallback: the kernel, variant, path taken, error and setting); returns the count."""
    events = kernel_fallback.events()
    for event in events[reported:]:
        metrics.write("fallback", step, dataclasses.asdict(event))
    return len(events)
