"""Time to first training step, broken down by phase.

``imports`` is the time from the process start (the kernel's clock for this process, so it
includes the interpreter, ``import torch`` / TorchRec and Hydra's composition) to ``train()``;
every other phase is timed with :meth:`StartupTimer.phase` around its code. ``first step compile``
breaks down torch.compile's share of the first step (:func:`compile_breakdown`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gem.train.logging import logger
from kernels import fallback as kernel_fallback


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


_FINISHED_RUNS_S = 0.0  # the time this process spent in train() calls that have returned


def count_finished_run(seconds: float) -> None:
    """Called as ``train()`` returns, so that a later run in the process (after a pretraining
    stage, say) does not count this one as its imports."""
    global _FINISHED_RUNS_S
    _FINISHED_RUNS_S += seconds


class StartupTimer:
    """Collects ``{phase: seconds}`` from the call to ``train()`` to the end of the first step;
    ``imports`` is the time before it since the process started, less earlier runs'."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        since_start = seconds_since_process_start()
        self.phases: dict[str, float] = {} if since_start is None else {"imports": since_start - _FINISHED_RUNS_S}
        self.compile: dict[str, float] | None = None  # compile_breakdown() of the first step

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        tick = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - tick

    def summary(self) -> dict[str, Any]:
        """Phases in order, ``first step compile`` (a dict, when anything was compiled), ``other``
        (untimed work since ``train()``), and ``total``."""
        in_train = time.perf_counter() - self.start
        timed = sum(v for k, v in self.phases.items() if k != "imports")
        out: dict[str, Any] = {k: round(v, 3) for k, v in self.phases.items()}
        if self.compile:
            out["first step compile"] = self.compile
        out["other"] = round(max(0.0, in_train - timed), 3)
        out["total"] = round(in_train + self.phases.get("imports", 0.0), 3)
        return out


def format_summary(values: dict[str, Any]) -> str:
    """:meth:`StartupTimer.summary` for the log: ``phase 1.23s, ...``, the compile breakdown in parentheses."""

    def one(k: str, v: Any) -> str:
        if not isinstance(v, dict):
            return f"{k} {v:.2f}s"
        return (
            f"{k} {v['total']:.2f}s (dynamo {v['dynamo']:.2f}s, backend {v['backend']:.2f}s, "
            f"backward {v['backward']:.2f}s; {v['frames']} frames, {v['graphs']} graphs)"
        )

    return ", ".join(one(k, v) for k, v in values.items() if k != "total")


def imported_from_source(module_name: str = "torch") -> bool:
    """Whether ``module_name`` was imported without a bytecode cache, so that every start compiles
    its Python sources again: ``PYTHONDONTWRITEBYTECODE`` set, or an install folder that cannot be
    written and holds no bytecode (an installer that skips it, as uv does by default). False for a
    module that is not imported or has no source."""
    cached = getattr(sys.modules.get(module_name), "__cached__", None)
    return cached is not None and not os.path.exists(cached)


def compile_counters() -> dict[str, float]:
    """torch.compile's cumulative work in this process: Dynamo's seconds by phase
    (``calculate_time_spent()``), ``frames`` converted and ``graphs`` compiled. Empty where Dynamo
    was never imported (so nothing was compiled) or its counters cannot be read."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    try:
        out = {k: float(v) for k, v in utils.calculate_time_spent().items()}
        out["frames"] = utils.counters.get("frames", {}).get("ok", 0)
        out["graphs"] = utils.counters.get("stats", {}).get("unique_graphs", 0)
    except Exception:  # torch's private counters differ between versions; a diagnostic never fails the run
        return {}
    return out


def compile_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """What torch.compile did between two :func:`compile_counters`, or None if nothing.

    ``total`` seconds = ``dynamo`` (tracing Python frames into graphs) + ``backend`` (AOTAutograd and
    Inductor on those graphs, loading cached graphs and kernels included) + ``backward`` (a backward
    graph that Inductor compiles lazily when it first runs; 0 when the cache had it); ``frames``
    converted and ``graphs`` compiled (more graphs than frames: graph breaks).
    """
    d = {k: v - before.get(k, 0) for k, v in after.items()}
    frame, backend = d.get("entire_frame_compile", 0.0), d.get("backend_compile", 0.0)
    backward = d.get("entire_backward_compile", 0.0)
    if frame + backward <= 0 and not d.get("frames"):
        return None
    return {
        "total": round(frame + backward, 3),
        "dynamo": round(max(0.0, frame - backend), 3),
        "backend": round(backend, 3),
        "backward": round(backward, 3),
        "frames": int(d.get("frames", 0)),
        "graphs": int(d.get("graphs", 0)),
    }


def start_compile_workers() -> None:
    """Start Inductor's pool of compile worker processes now (what its backend does when it first
    compiles), so that the workers start up during the data and model build instead of inside the
    first step, whose kernels they compile or, with warm caches, load. ``TORCH_WARM_POOL=0`` or
    ``TORCHINDUCTOR_COMPILE_THREADS=1`` turn the pool off, as for torch.compile itself."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


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


def log_startup(
    timer: StartupTimer, first_step_s: float, metrics, run_dir: Path, local_rank: int, is_main: bool
) -> None:
    """Time to the end of the first step, by phase (the first step includes any compile and
    warm-up, broken down when anything was compiled), in the log, the metrics and ``startup.json``
    with the kernels that fell back by then (kernels.fallback)."""
    timer.phases["first step"] = first_step_s
    values = timer.summary()
    logger.info("time to first step %.2fs: %s", values["total"], format_summary(values))
    if local_rank == 0 and imported_from_source("torch"):  # the same for every rank of a host
        logger.warning(
            "imports compiled torch's Python sources: no bytecode cache (PYTHONDONTWRITEBYTECODE is set, or "
            "the install folder is read-only and holds none); PYTHONPYCACHEPREFIX=<a writable folder> keeps it "
            "between runs (imports 15 s -> 6 s on a 2-core CPU)"
        )
    metrics.write("startup", 0, values)
    if is_main:
        fell_back = [dataclasses.asdict(event) for event in kernel_fallback.events()]
        (run_dir / "startup.json").write_text(json.dumps(values | {"kernel_fallbacks": fell_back}, indent=2))
