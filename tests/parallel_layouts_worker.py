"""Every (parallelism option, model) case of tests/test_parallel_layouts.py, trained in one torchrun.

    torchrun --nproc_per_node=2 tests/parallel_layouts_worker.py --out DIR \\
        --cases '[{"name": "fsdp-interformer", "overrides": ["parallelism=fsdp", "model=gem_tiny"]}]' \\
        -- debug=tiny trainer.max_steps=3

Each case is one ``train(cfg)`` call in this process, on the config ``python -m gem.train <overrides after
--> <the case's overrides> trainer.run_dir=DIR/<name>`` would run; the process group started here (with a
short timeout) serves every case, as ``train()`` uses the one it finds. A torchrun start costs seconds of
imports per rank, a case a second or two.

Every rank writes ``DIR/results/<name>.rank<r>.json``: ``{"ok": true, "seconds": s}``, or ``{"ok": false,
"error": <the exception's last line>, "traceback": ...}`` (also printed to stderr). It goes on to the next
case once every rank has written its file for this one, so a failure that every rank meets (a bad dtype
in the forward, say) is reported for each case it breaks. A rank whose peers have not finished a case
within ``--wait`` seconds (one stuck in a collective that a failed rank left) exits 1, and torchrun stops
the others. The exit status is 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by torchrun

from gem.train.api import compose  # noqa: E402
from gem.train.trainer import train  # noqa: E402

COLLECTIVE_TIMEOUT_S = 60  # a collective that a failed rank left waits this long, not train()'s 10 minutes


def say(line: str) -> None:
    """One line to stderr in one write (the ranks share torchrun's stderr)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def result_file(out: Path, name: str, rank: int) -> Path:
    return out / "results" / f"{name}.rank{rank}.json"


def run_case(name: str, overrides: list[str], out: Path, rank: int) -> dict:
    tick = time.perf_counter()
    try:
        train(compose([*overrides, f"trainer.run_dir={out / name}"]))
    except Exception as e:  # reported per case; the next case runs if every rank got this far
        error = traceback.format_exception_only(e)[-1].strip()
        say(f"[rank{rank}] case {name} failed: {error}")
        return {"ok": False, "error": error, "traceback": traceback.format_exc()}
    return {"ok": True, "seconds": round(time.perf_counter() - tick, 2)}


def wait_for_peers(out: Path, name: str, world_size: int, wait_s: float) -> None:
    """Returns once every rank has written its result of case ``name``; exits 1 after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    missing = list(range(world_size))
    while missing:
        missing = [r for r in missing if not result_file(out, name, r).exists()]
        if missing and time.monotonic() > deadline:
            say(
                f"[rank{dist.get_rank()}] rank(s) {missing} did not finish case {name} within {wait_s:.0f} s "
                "(stuck in a collective?); stopping"
            )
            os._exit(1)
        time.sleep(0.05)


def main() -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True, help='JSON: [{"name": ..., "overrides": [...]}, ...]')
    parser.add_argument("--wait", type=float, default=COLLECTIVE_TIMEOUT_S + 30, help="seconds to wait for peers")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every case")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    (args.out / "results").mkdir(parents=True, exist_ok=True)
    all_ok = True
    for case in json.loads(args.cases):
        name = case["name"]
        result = run_case(name, [*args.overrides, *case["overrides"]], args.out, rank)
        all_ok &= result["ok"]
        partial = result_file(args.out, name, rank).with_suffix(".tmp")
        partial.write_text(json.dumps(result))
        partial.rename(result_file(args.out, name, rank))  # a peer never reads half a file
        wait_for_peers(args.out, name, world_size, args.wait)
        say(f"[rank{rank}] case {name}: {'ok' if result['ok'] else 'failed'}")
    dist.destroy_process_group()
    return all_ok


if __name__ == "__main__":
    ok = main()
    if ok:  # as python -m gem.train ends a finished rank (docs/distributed.md, "Launching with torchrun")
        from gem.train.__main__ import exit_without_finalization

        exit_without_finalization()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
