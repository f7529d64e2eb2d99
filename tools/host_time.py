"""How long the host takes to issue a training step: ``python tools/host_time.py [options] [-- overrides]``.

Builds the run the Hydra overrides describe (default ``experiment=gem_base_h200``) through the
library API (``gem.build_data`` / ``build_model`` / ``build_optimizers``), trains ``--warmup``
steps with the trainer's ``TrainStep`` (compile, autotune), then times ``--steps`` more twice:

* host: the wall time of issuing the steps, the device's queue drained before and not waited
  on during them; on a GPU the step's Python, dispatch and launch work, as long as the host
  stays ahead of the device (if it is slower than the host, the launch queue fills and the
  figure approaches the device time);
* until done: the same steps until the device has finished them.

A step whose host time is about its device time cannot get faster from faster kernels: the
host is the wall. With ``--cprofile`` a third timing runs under cProfile and prints its top
functions (the main thread's: the autograd engine's own threads are not profiled). On a GPU it
also counts the caching allocator's cudaMalloc / cudaFree calls during the steps, and
``--find-sync`` runs one step that stops at its first synchronizing CUDA call. ``--repeat-batch``
trains on one batch throughout (shapes that never change), and ``--compile-arch MODE`` compiles
the whole dense arch in a ``torch.compile`` mode (``reduce-overhead``: CUDA graphs), to measure
what static shapes and graphs would give. Writes a JSON (``--out``) with both figures per step,
the device, versions and commit.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import itertools
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gem  # noqa: E402
from benchmarks.scaling import environment  # noqa: E402
from gem.train.step import TimedIterator, TrainStep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=25, help="steps before the timings (compile, autotune)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--cprofile", action="store_true", help="also profile the steps with cProfile")
    parser.add_argument("--out", default=None, help="JSON to write (default: print only)")
    parser.add_argument(
        "--repeat-batch", action="store_true", help="train on the first batch again and again (static shapes)"
    )
    parser.add_argument(
        "--compile-arch",
        default=None,
        metavar="MODE",
        help="torch.compile the whole dense arch in this mode (default, reduce-overhead, ...) instead of "
        "the blocks; needs parallelism.compile=false",
    )
    parser.add_argument(
        "--find-sync",
        action="store_true",
        help="after the warm-up, run one step that raises at its first synchronizing CUDA call, with the "
        "forward traceback of the autograd node that made it (torch.cuda.set_sync_debug_mode + anomaly mode)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: experiment=gem_base_h200)")
    args = parser.parse_args()
    overrides = args.overrides or ["experiment=gem_base_h200"]
    cfg = gem.compose(overrides)
    if args.compile_arch and cfg.parallelism.compile:
        sys.exit("--compile-arch compiles the dense arch itself: add parallelism.compile=false")
    steps_needed = args.warmup + args.steps * (3 if args.cprofile else 2)
    data = gem.build_data(cfg)
    model = gem.build_model(data)
    optimizers = gem.build_optimizers(model, data, total_steps=steps_needed)
    device = data.device
    dtype = getattr(torch, data.config.trainer.autocast) if data.config.trainer.autocast else None
    if args.compile_arch:  # static shapes for one repeated batch; real batches: dynamic after a first recompile
        model.dense_arch.compile(mode=args.compile_arch, fullgraph=True, dynamic=False if args.repeat_batch else None)
    graphs = args.compile_arch is not None and "reduce-overhead" in args.compile_arch
    train_step = TrainStep(model, data.loss, optimizers, device, pipelined=False, autocast=dtype)  # the trainer's
    batches = iter(data.loader("train"))
    if args.repeat_batch:
        batches = itertools.repeat(next(batches))
    batches = TimedIterator(batches)  # the time spent waiting for the loader

    def step() -> None:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            train_step(batches)
        except StopIteration:
            sys.exit(f"the train split ends before {steps_needed} steps: set data.num_examples.train higher")

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    synchronize()
    if args.find_sync and device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autograd.detect_anomaly(check_nan=False):
                step()
            print("find-sync: the step made no synchronizing CUDA call")
        except RuntimeError as e:
            print(f"find-sync: {e}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        synchronize()
    allocator = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    before = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    waited = batches.waited
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    issued = time.perf_counter()
    synchronize()
    done = time.perf_counter()
    result = {
        "host_ms_per_step": 1e3 * (issued - start) / args.steps,
        "until_done_ms_per_step": 1e3 * (done - start) / args.steps,
        "data_wait_ms_per_step": 1e3 * (batches.waited - waited) / args.steps,
    }
    if device.type == "cuda":  # cudaMalloc / cudaFree calls (a cudaFree waits for the device) during the steps
        after = torch.cuda.memory_stats(device)
        result["allocator_calls"] = {k: after.get(k, 0) - before.get(k, 0) for k in allocator}
        print(f"caching allocator during the steps: {result['allocator_calls']}")
    print(
        f"{args.steps} steps: host {result['host_ms_per_step']:.1f} ms a step, "
        f"until done {result['until_done_ms_per_step']:.1f} ms, waiting for the loader "
        f"{result['data_wait_ms_per_step']:.1f} ms"
    )
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            step()
        synchronize()
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        print(text.getvalue())
    if args.out:
        record = {
            "benchmark": "host_time",
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            **environment(),
            "overrides": overrides,
            "repeat_batch": args.repeat_batch,
            "compile_arch": args.compile_arch,
            "warmup": args.warmup,
            "steps": args.steps,
            **result,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
