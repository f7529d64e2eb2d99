"""``trainer.profile``: record chosen training steps with ``torch.profiler`` and say where the time went.

For ``trainer.profile.start=S trainer.profile.steps=N`` the steps S .. S+N-1 are recorded (step S-1
is the profiler's warm-up, not counted) and, when they are done, every rank writes into
``<run_dir>/profile/``:

* ``trace_rank<r>.json.gz`` - the Chrome / Perfetto trace (open it in https://ui.perfetto.dev);
* ``breakdown_rank<r>.json`` - device time per step by kind (:data:`KINDS`), the idle share, and the
  largest kernels.

On a GPU the breakdown classifies the CUDA kernels and memory copies; the span from the first
kernel's start to the last one's end, less the union of all kernel intervals, is ``idle`` (the GPU
waiting for the host). On a CPU it classifies the self time of the recorded operators instead,
and ``idle`` is the wall time no operator accounts for (Python, the data loader, waiting).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from gem.train.config import ProfileConfig
from gem.train.logging import logger

# The breakdown's kinds. _PATTERNS are tried in their order: the first kind whose patterns occur
# in a (lower-cased) kernel or operator name wins; whatever matches none is elementwise work
# (Inductor's fused pointwise and reduction kernels, aten's elementwise, normalization, copies and casts).
KINDS = ("communication", "memcpy", "attention", "gemm", "embedding", "optimizer", "elementwise")
_PATTERNS = {
    "communication": (
        "nccl",
        "all_reduce",
        "allreduce",
        "all_gather",
        "allgather",
        "reduce_scatter",
        "all_to_all",
        "alltoall",
        "c10d::",
        "gloo",
    ),
    "memcpy": ("memcpy", "memset"),
    # gem's Triton / Gluon attention and attention-pooling kernels (and their order / work-list
    # helpers), PyTorch's SDPA
    "attention": (
        "_fwd_kernel",
        "_pool_bwd_kernel",  # (its forward matches "_fwd_kernel")
        "_bwd_dkdv",
        "_bwd_dq",
        "_bwd_preprocess",
        "_batch_order_kernel",
        "_gdpa_",
        "_work_list_kernel",
        "gem_kernels::",
        "flash",
        "fmha",
        "attention",
        "sdpa",
        "cudnn_generated_fort_native_sdpa",
    ),
    # before "gemm", which "fbgemm" (the embedding kernels' library) contains
    "embedding": (
        "embedding",
        "index_select",
        "indexselect",
        "index_add",
        "indexing_backward",
        "index_put",
        "gather",
        "scatter",
        "aten::index",
        "segment_reduce",
        "compute_grad_weight",
        "fbgemm",
    ),
    "gemm": (
        "gemm",
        "nvjet",
        "cutlass",
        "xmma",
        "cublas",
        "matmul",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "triton_tem_fused",
        "_scaled_mm",
        "splitk",
    ),
    "optimizer": ("adam", "adagrad", "multi_tensor_apply", "optimizer", "_foreach_"),
}


def kind_of(name: str) -> str:
    """The kind (one of :data:`KINDS`) of a kernel or operator name."""
    lower = name.lower()
    for kind, patterns in _PATTERNS.items():
        if any(p in lower for p in patterns):
            return kind
    return "elementwise"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def breakdown(events, num_steps: int, wall_us: float | None = None, top: int = 30) -> dict:
    """Time per step by kind from a profiler's ``events()``.

    Args:
        events: ``prof.events()`` of the recorded steps.
        num_steps: how many training steps they cover.
        wall_us: the recorded steps' wall time (CPU runs; a GPU run takes the kernels' span).
        top: how many of the largest kernels (or operators) to list.
    """
    # (user annotations, e.g. ProfilerStep# or Optimizer.step, also appear on the GPU's timeline)
    kernels = [
        e
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0 and not e.is_user_annotation
    ]
    on_gpu = bool(kernels)
    if on_gpu:
        timed = [(e.name, e.time_range.elapsed_us()) for e in kernels]
        intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
        span = max(hi for _, hi in intervals) - min(lo for lo, _ in intervals)
        busy = _union_length(intervals)
    else:  # operators' self time; nested calls are not counted twice
        timed = [
            (e.name, e.self_cpu_time_total)
            for e in events
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0 and not e.name.startswith("ProfilerStep")
        ]
        busy = sum(t for _, t in timed)
        span = max(wall_us or 0.0, busy)
    by_kind = {k: 0.0 for k in KINDS}
    per_name: dict[str, list] = {}
    for name, us in timed:
        kind = kind_of(name)
        by_kind[kind] += us
        entry = per_name.setdefault(name, [kind, 0, 0.0])
        entry[1] += 1
        entry[2] += us
    per_step = lambda us: round(us / 1000 / max(num_steps, 1), 4)  # noqa: E731
    largest = sorted(per_name.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "device": "cuda" if on_gpu else "cpu",
        "steps": num_steps,
        "ms_per_step": per_step(span),
        "busy_ms_per_step": per_step(busy),
        "idle_frac": round(1 - busy / span, 4) if span > 0 else 0.0,
        "ms_per_step_by_kind": {k: per_step(v) for k, v in by_kind.items()} | {"idle": per_step(max(span - busy, 0.0))},
        "frac_of_busy_by_kind": {k: round(v / busy, 4) if busy > 0 else 0.0 for k, v in by_kind.items()},
        "top": [
            {
                "name": name[:160],
                "kind": kind,
                "calls_per_step": round(calls / max(num_steps, 1), 2),
                "ms_per_step": per_step(us),
            }
            for name, (kind, calls, us) in largest
        ],
    }


class StepProfiler:
    """Records training steps ``start .. start+steps-1`` with torch.profiler; call :meth:`step`
    after every training step and :meth:`close` at the end.

    Args:
        cfg: ``trainer.profile``.
        out_dir: where the trace and breakdown go (``<run_dir>/profile``).
        rank: names the files.
        first_step: the step the loop starts from (after a resume), so that ``start`` keeps
            meaning a training step.
        on_cuda: record CUDA kernels as well as CPU operators.
    """

    def __init__(self, cfg: ProfileConfig, out_dir: Path, rank: int, first_step: int, on_cuda: bool) -> None:
        self.cfg, self.out_dir, self.rank, self.on_cuda = cfg, out_dir, rank, on_cuda
        self.result: dict | None = None
        begin = cfg.start - 1 - first_step  # loop iterations before the first recorded step
        self.enabled = cfg.start > 0 and begin >= 0
        self._prof = None
        self._drain = {begin - 1, begin + cfg.steps - 1}  # the iterations before recording starts and as it ends
        self._iteration = 0
        if cfg.start > 0 and begin < 0:
            logger.warning(
                "trainer.profile.start=%d: training resumes after step %d, nothing is recorded", cfg.start, first_step
            )
        if not self.enabled:
            return
        if on_cuda:
            # Kineto detaches CUPTI when a recording stops only with TEARDOWN_CUPTI=1; left attached,
            # it slows every later kernel launch. torch sets 0 itself where CUDA graphs need it kept.
            os.environ.setdefault("TEARDOWN_CUPTI", "1")
        warmup = 1 if begin >= 1 else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=begin - warmup, warmup=warmup, active=cfg.steps, repeat=1),
            on_trace_ready=self._write,
        )
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is None:
            return
        if self.on_cuda and self._iteration in self._drain:
            # the GPU's queue drained as recording starts and ends: the recording holds the recorded
            # steps' kernels only, none still queued from the step before it
            torch.cuda.synchronize()
        self._iteration += 1
        self._prof.step()
        if self.result is not None:  # the recorded steps are written: stop the profiler, free its events
            self.close()

    def close(self) -> None:
        """Stops the profiler (writing the results if the recorded steps were reached); after the
        recorded steps :meth:`step` does it, so that the steps after them run without it."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def _write(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        events = prof.events()
        steps = [e for e in events if e.name.startswith("ProfilerStep#")]
        wall_us = sum(e.time_range.elapsed_us() for e in steps) if steps else None
        num_steps = len(steps) or self.cfg.steps
        self.result = breakdown(events, num_steps, wall_us, self.cfg.top)
        self.result["recorded_steps"] = [self.cfg.start, self.cfg.start + num_steps - 1]
        (self.out_dir / f"breakdown_rank{self.rank}.json").write_text(json.dumps(self.result, indent=2))
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(self.out_dir / f"trace_rank{self.rank}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
