"""Test-only hooks, switched on by environment variables (never by the config):

- ``GEM_TEST_KILL_AT=<step>:<rank>``: that rank SIGKILLs itself right after finishing that step,
  in the first attempt of a torchrun job only (``TORCHELASTIC_RESTART_COUNT`` is 0), so that
  ``torchrun --max-restarts`` restarts the job once and the restart runs to the end.
- ``GEM_TEST_EXAMPLE_LOG=<folder>``: every rank appends one JSON line per step to
  ``<folder>/rank<r>.jsonl``: the attempt, the step and a 64-bit hash of each example's dense
  row, so a test can count which examples the surviving training history consumed.

Both cost two dictionary lookups per step when unset.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import torch

from gem.data.batch import Batch


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def example_ids(dense: torch.Tensor) -> list[str]:
    """A hash of each example's dense row ``[B, num_dense]`` (continuous random features: unique)."""
    rows = dense.detach().cpu().contiguous().numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in rows]


def after_step(step: int, rank: int, batch: Batch) -> None:
    log, kill = os.environ.get("GEM_TEST_EXAMPLE_LOG"), os.environ.get("GEM_TEST_KILL_AT")
    if log:
        with (Path(log) / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps({"attempt": attempt(), "step": step, "ids": example_ids(batch.dense)}) + "\n")
    if kill and attempt() == 0 and kill == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)
