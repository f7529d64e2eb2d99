"""Micro-benchmarks that describe a CPU machine to the step-time model (gem/plan/steptime.py).

On a CPU a "device" is a rank with ``threads`` intra-op threads (``trainer.num_threads``), and the
"node link" is gloo over loopback. :func:`measure_cpu` measures, with that thread count:

- **compute**: fp32 matmul throughput at an MLP's shape (``plan.peak_tflops``; the fitted
  ``plan.mfu`` is then the share of it the whole dense step reaches);
- **memory**: a large copy's read + write bandwidth (``plan.hbm_gbps``; the fitted
  ``plan.embedding_efficiency`` is the share of it the table lookups and fused updates reach);
- both with 1 and with 2 processes running them at once: ranks on one host share its cores,
  caches and memory bus (and, on a shared machine, the other users' load), so a rank's rates
  depend on how many ranks run (:meth:`CPUMachine.overrides` takes the count);
- **link**: ``all_to_all_single`` between two gloo processes at several message sizes, fitted
  ``time = latency + bytes / bandwidth`` (``plan.intra_node_gbps``, ``plan.collective_latency_ms``);
  bytes are those one rank sends to the other (what the model counts per rank).

Each figure is the median of ``repeats`` timings; the spread (min, max) is kept beside it, since a
shared machine is noisy. :meth:`CPUMachine.overrides` gives the ``plan.*`` overrides.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

LINK_SIZES = (2**12, 2**16, 2**19, 2**21, 2**23)  # bytes one rank sends to the other


@dataclass
class CPUMachine:
    """Per-rank rates of a host running ``ranks`` ranks at once (each of ``threads`` threads): the
    ranks share the host's cores, caches and memory bus, so a rank computes slower beside others."""

    threads: int
    matmul_gflops: dict[int, float]  # ranks running at once -> GFLOP/s of one rank (median over ranks and repeats)
    copy_gbps: dict[int, float]  # ... GB/s of one rank
    link_gbps: float
    link_latency_ms: float
    spread: dict[str, list[float]] = field(default_factory=dict)  # figure -> [min, max] over repeats (and ranks)
    link_points: list[list[float]] = field(default_factory=list)  # [bytes, median ms] per message size

    def __post_init__(self) -> None:  # JSON keys are strings
        self.matmul_gflops = {int(k): v for k, v in self.matmul_gflops.items()}
        self.copy_gbps = {int(k): v for k, v in self.copy_gbps.items()}

    def overrides(self, ranks: int = 1, rates: dict[str, float] | None = None) -> list[str]:
        """The ``plan.*`` overrides that describe this host running ``ranks`` ranks (one node);
        ``rates`` (``matmul_gflops``, ``copy_gbps``), measured at another moment, replace the stored ones."""
        if rates is None:
            if ranks not in self.matmul_gflops:
                raise ValueError(
                    f"no rates measured for {ranks} ranks at once (measured: {sorted(self.matmul_gflops)})"
                )
            rates = {"matmul_gflops": self.matmul_gflops[ranks], "copy_gbps": self.copy_gbps[ranks]}
        return [
            "plan.device=cpu",
            f"plan.peak_tflops={rates['matmul_gflops'] / 1e3:.6g}",
            f"plan.hbm_gbps={rates['copy_gbps']:.6g}",
            f"plan.intra_node_gbps={self.link_gbps:.6g}",
            f"plan.collective_latency_ms={self.link_latency_ms:.6g}",
        ]

    def to_json(self) -> dict:
        return asdict(self)


def _timed(fn, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def matmul_gflops(threads: int, m: int = 512, k: int = 1024, n: int = 1024, repeats: int = 15) -> list[float]:
    """GFLOP/s of ``[m, k] @ [k, n]`` fp32 (forward-and-backward-sized MLP matmuls), one per repeat."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        times = _timed(lambda: torch.mm(a, b, out=out), repeats)
    finally:
        torch.set_num_threads(old)
    return [2 * m * k * n / t / 1e9 for t in times]


def copy_gbps(threads: int, megabytes: int = 128, repeats: int = 9) -> list[float]:
    """GB/s read + written by a copy of ``megabytes`` (larger than any cache), one per repeat."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randn(megabytes * 2**20 // 4)
        dst = torch.empty_like(src)
        times = _timed(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(old)
    return [2 * src.numel() * 4 / t / 1e9 for t in times]


def _rates_worker(rank: int, ranks: int, init_file: str, threads: int, repeats: int, out_dir: str) -> None:
    """Every rank times the matmul, then the copy, starting together (a gloo barrier before each)."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    try:
        dist.barrier()
        flops = matmul_gflops(threads, repeats=repeats)
        dist.barrier()
        copy = copy_gbps(threads, repeats=max(5, repeats // 2))
        with open(os.path.join(out_dir, f"rates{rank}.json"), "w") as f:
            json.dump({"matmul_gflops": flops, "copy_gbps": copy}, f)
    finally:
        dist.destroy_process_group()


def concurrent_rates(ranks: int, threads: int, repeats: int = 15) -> dict[str, list[float]]:
    """Matmul GFLOP/s and copy GB/s of each of ``ranks`` processes running them at once (all timings)."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_rates_worker, args=(ranks, init, threads, repeats, tmp), nprocs=ranks, join=True)
        out: dict[str, list[float]] = {"matmul_gflops": [], "copy_gbps": []}
        for r in range(ranks):
            with open(os.path.join(tmp, f"rates{r}.json")) as f:
                for k, v in json.load(f).items():
                    out[k] += v
        return out


def fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(GB/s, latency ms)`` of ``ms = latency + bytes / bandwidth`` fitted to ``(bytes, ms)`` points
    by least squares, weighting each point by 1 / ms (relative error, so small messages count)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / y
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (latency, slope), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    if slope <= 0:
        raise ValueError(f"link benchmark: time does not grow with message size ({points}); rerun on a quieter machine")
    return 1.0 / slope / 1e6, max(float(latency), 0.0)


def _link_worker(rank: int, init_file: str, threads: int, repeats: int, out_file: str) -> None:
    import json

    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        result = {}
        for size in LINK_SIZES:  # each rank sends `size` bytes to the other and keeps as many
            send = torch.zeros(2 * size // 4)
            recv = torch.empty_like(send)

            def step(send=send, recv=recv):
                dist.all_to_all_single(recv, send)

            dist.barrier()
            times = _timed(step, repeats, warmup=3)
            result[size] = [t * 1e3 for t in times]
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def link_times(threads: int, repeats: int = 15) -> dict[int, list[float]]:
    """Milliseconds per ``all_to_all_single`` on two gloo processes of ``threads`` threads, by bytes sent."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "times.json")
        mp.spawn(_link_worker, args=(init, threads, repeats, out), nprocs=2, join=True)
        with open(out) as f:
            return {int(k): v for k, v in json.load(f).items()}


def measure_cpu(threads: int = 1, ranks: tuple[int, ...] = (1, 2), repeats: int = 15) -> CPUMachine:
    """Measure this host for ranks of ``threads`` threads, ``ranks`` of them at once (module docstring)."""
    rates = {n: concurrent_rates(n, threads, repeats) for n in ranks}
    link = link_times(threads, repeats)
    points = [(float(size), statistics.median(ms)) for size, ms in sorted(link.items())]
    gbps, latency = fit_link(points)
    spread = {}
    for n, r in rates.items():
        spread |= {f"{k}_{n}_ranks": [min(v), max(v)] for k, v in r.items()}
    return CPUMachine(
        threads,
        {n: statistics.median(r["matmul_gflops"]) for n, r in rates.items()},
        {n: statistics.median(r["copy_gbps"]) for n, r in rates.items()},
        gbps,
        latency,
        spread=spread | {f"link_ms_{size}": [min(ms), max(ms)] for size, ms in sorted(link.items())},
        link_points=[list(p) for p in points],
    )
