"""Time to first training step, broken down by phase.

``imports`` is the time from the process start (the kernel's clock for this process, so it
includes the interpreter, ``import torch`` / TorchRec and Hydra's composition) to ``train()``;
every other phase is timed with :meth:`StartupTimer.phase` around its code.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartupTimer:
    """Collects ``{phase: seconds}`` from the call to ``train()`` to the end of the first step."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        since_start = seconds_since_process_start()
        self.phases: dict[str, float] = {"imports": since_start} if since_start is not None else {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        tick = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - tick

    def summary(self) -> dict[str, float]:
        """Phases in order, ``other`` (untimed work since ``train()``), and ``total``."""
        in_train = time.perf_counter() - self.start
        timed = sum(v for k, v in self.phases.items() if k != "imports")
        out = {k: round(v, 3) for k, v in self.phases.items()}
        out["other"] = round(max(0.0, in_train - timed), 3)
        out["total"] = round(in_train + self.phases.get("imports", 0.0), 3)
        return out
