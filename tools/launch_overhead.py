"""The host's time per kernel launch before and after a ``torch.profiler`` recording:
``python tools/launch_overhead.py`` (on a GPU; run it once as is and once with ``TEARDOWN_CUPTI=1``).

Kineto detaches NVIDIA's CUPTI when a recording stops only if ``TEARDOWN_CUPTI=1`` is set then;
otherwise CUPTI stays attached to the process and every later launch pays for it.
``trainer.profile`` sets it (``gem/train/profile.py``). Prints JSON: microseconds per launch of a
small in-place add, three timings of ``--launches`` each, before any recording, after one
(profiler still open) and after the profiler exits.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule


def per_launch_us(x: torch.Tensor, launches: int) -> float:
    """Host microseconds per launch of ``x.add_(1)``, the device's queue drained before."""
    torch.cuda.synchronize()
    tick = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    elapsed = time.perf_counter() - tick
    torch.cuda.synchronize()
    return round(elapsed / launches * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20000)
    args = parser.parse_args()
    x = torch.zeros(16, device="cuda")
    timings = lambda: [per_launch_us(x, args.launches) for _ in range(3)]  # noqa: E731
    result = {"TEARDOWN_CUPTI": os.environ.get("TEARDOWN_CUPTI"), "before": timings()}
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(6):  # two steps recorded, then two more with the schedule done
            x.add_(1)
            prof.step()
        result["after a recording, profiler open"] = timings()
    result["after the profiler exits"] = timings()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
