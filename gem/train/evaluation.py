"""Evaluation: per-task AUC / NE and ranking metrics over a split, and a stream's progressive metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gem.data.errors import DataError
from gem.data.pipeline.loader import BatchLoader
from gem.train.logging import format_metrics, logger
from gem.train.metrics import RankingEvaluator, TaskEvaluator
from gem.train.setup import DistEnv
from gem.train.step import autocast


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: BatchLoader,
    env: DistEnv,
    tasks: tuple[str, ...],
    max_batches: int = -1,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Per-task AUC / NE over a split, plus ranking metrics (HR, NDCG, MRR) when it has candidate
    groups (request ids). Every rank runs the same number of forward passes (sharded tables need
    all ranks in each step); a rank out of batches repeats its last one unrecorded. Torch's random
    state is restored after it, so evaluating mid-run leaves the training run as it would have been."""
    cuda = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        return _evaluate(model, loader, env, tasks, max_batches, autocast_dtype)


def _evaluate(
    model: nn.Module,
    loader: BatchLoader,
    env: DistEnv,
    tasks: tuple[str, ...],
    max_batches: int,
    autocast_dtype: torch.dtype | None,
) -> dict[str, float]:
    model.eval()
    evaluator, ranking = TaskEvaluator(tasks), RankingEvaluator(tasks)
    steps = max(loader.reader.num_batches(r) for r in range(env.world_size))
    if steps == 0:
        raise DataError(
            f"evaluation split {loader.reader.files[0].parent if loader.reader.files else ''} has no "
            "examples: AUC and NE would be NaN"
        )
    if max_batches > 0:
        steps = min(steps, max_batches)
    batch = None
    it = iter(loader)
    for _ in range(steps):
        nxt = next(it, None)
        real = nxt is not None
        batch = nxt.to(env.device, non_blocking=True) if real else batch
        if batch is None:
            raise DataError("evaluation split is empty; add examples to data.dir/val and data.dir/test")
        with autocast(env.device, autocast_dtype):
            logits = model(batch).float()
        if real:
            evaluator.update(logits, batch.labels, batch.label_mask)
            if batch.request_id is not None:
                ranking.update(logits, batch.labels, batch.label_mask, batch.request_id)
    model.train()
    return evaluator.compute() | (ranking.compute() if ranking.has_groups() else {})


def score_partition(
    model: nn.Module,
    loader: BatchLoader,
    env: DistEnv,
    tasks: tuple[str, ...],
    partition: str,
    max_batches: int,
    autocast_dtype: torch.dtype | None,
) -> dict[str, float]:
    """Progressive evaluation of a stream: ``partition``'s metrics before the model trains on it."""
    values = evaluate(model, loader, env, tasks, max_batches, autocast_dtype)
    logger.info("partition %s, scored before training on it: %s", partition, format_metrics(values))
    return values


def stream_summary(run_dir: Path, scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """The mean of every partition's progressive metrics (this run's ``scores`` and, after a restart,
    the earlier ones from metrics.jsonl), and ``<run_dir>/stream_metrics.json`` with each partition's."""
    path = run_dir / "metrics.jsonl"
    earlier = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    every = {
        r["partition"]: {k: v for k, v in r.items() if k not in ("kind", "step", "time", "partition")}
        for r in earlier
        if r.get("kind") == "stream"
    } | scores
    keys = sorted({k for v in every.values() for k, x in v.items() if isinstance(x, (int, float))})
    mean = {k: float(np.nanmean([v.get(k, float("nan")) for v in every.values()])) for k in keys}
    (run_dir / "stream_metrics.json").write_text(json.dumps({"mean": mean, "partitions": every}, indent=1))
    return mean | {"partitions": float(len(every))}
