"""Console and JSON-lines logging for rank 0."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

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
    """Appends one JSON object per line to ``<run_dir>/metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.write_text("")

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if self.path is None:
            return
        row = {"kind": kind, "step": step, "time": time.time(), **{k: _clean(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN
    return v


def format_metrics(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
