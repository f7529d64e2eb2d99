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
functions (the main thread's: the autograd engine's own threads are not profiled). Writes a JSON
(``--out``) with both figures per step, the device, versions and commit.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
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
from gem.train.step import TrainStep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=25, help="steps before the timings (compile, autotune)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--cprofile", action="store_true", help="also profile the steps with cProfile")
    parser.add_argument("--out", default=None, help="JSON to write (default: print only)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: experiment=gem_base_h200)")
    args = parser.parse_args()
    overrides = args.overrides or ["experiment=gem_base_h200"]
    cfg = gem.compose(overrides)
    steps_needed = args.warmup + args.steps * (3 if args.cprofile else 2)
    data = gem.build_data(cfg)
    model = gem.build_model(data)
    optimizers = gem.build_optimizers(model, data, total_steps=steps_needed)
    device = data.device
    dtype = getattr(torch, data.config.trainer.autocast) if data.config.trainer.autocast else None
    train_step = TrainStep(model, data.loss, optimizers, device, pipelined=False, autocast=dtype)  # the trainer's
    batches = iter(data.loader("train"))

    def step() -> None:
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
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    issued = time.perf_counter()
    synchronize()
    done = time.perf_counter()
    result = {
        "host_ms_per_step": 1e3 * (issued - start) / args.steps,
        "until_done_ms_per_step": 1e3 * (done - start) / args.steps,
    }
    print(
        f"{args.steps} steps: host {result['host_ms_per_step']:.1f} ms a step, "
        f"until done {result['until_done_ms_per_step']:.1f} ms"
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
            "warmup": args.warmup,
            "steps": args.steps,
            **result,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
