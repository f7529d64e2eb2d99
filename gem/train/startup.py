"""Time to first training step, broken down by phase.

``imports`` is the time from the process start (the kernel's clock for this process, so it
includes the interpreter, ``import torch`` / TorchRec and Hydra's composition) to ``train()``;
every other phase is timed with :meth:`StartupTimer.phase` around its code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


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


# -- CPU threads ---------------------------------------------------------------------------------


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs this process's cgroup may use per period (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``),
    or None when unlimited or unknown."""
    try:
        with open(proc_cgroup) as f:
            own = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), "/")
    except OSError:
        own = "/"
    for path in (f"{root}{own.rstrip('/')}/cpu.max", f"{root}/cpu.max"):
        try:
            with open(path) as f:
                quota, period = f.read().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    try:
        with open(f"{root}/cpu/cpu.cfs_quota_us") as f, open(f"{root}/cpu/cpu.cfs_period_us") as g:
            quota, period = int(f.read()), int(g.read())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def available_cpus() -> tuple[int, str]:
    """CPUs this process can run on: its affinity mask, capped by the cgroup's CPU quota (rounded
    down, at least 1); and how that was decided, for the log."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_limit()
    cpus = affinity if quota is None else max(1, min(affinity, int(quota)))
    return cpus, f"affinity {affinity}, cgroup quota {'none' if quota is None else f'{quota:g}'}"


def configure_threads(requested: int | None, num_workers: int, local_world_size: int = 1) -> str:
    """Set torch's intra-op threads and return a log line saying why.

    ``requested`` (``trainer.num_threads``) wins, then an explicit ``OMP_NUM_THREADS`` (torchrun sets
    1 with several ranks per node). Otherwise: the available CPUs (:func:`available_cpus`) shared
    by the ranks of this node, less one per DataLoader worker process. torch's default is every
    core, which with a worker process beside it oversubscribes the CPUs: OpenMP's threads spin at
    barriers and wait for each other when one is descheduled, so one busy process beside a
    2-core quickstart made it 4x slower (README, "Threads").
    """
    import torch

    if requested:
        torch.set_num_threads(requested)
        return f"cpu threads: {requested} intra-op (trainer.num_threads)"
    if os.environ.get("OMP_NUM_THREADS"):
        return f"cpu threads: {torch.get_num_threads()} intra-op (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    cpus, how = available_cpus()
    threads = max(1, cpus // max(1, local_world_size) - num_workers)
    torch.set_num_threads(threads)
    return (
        f"cpu threads: {threads} intra-op ({cpus} CPUs available: {how}; {local_world_size} rank(s) on this "
        f"node, {num_workers} DataLoader worker(s) per rank; trainer.num_threads=N to override)"
    )
