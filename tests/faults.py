"""Fault injection for the checkpoint tests: step hooks handed to ``train(cfg, hooks=...)``, and a
torchrun entry point that trains with them.

    torchrun --nproc_per_node=2 --max-restarts=1 tests/faults.py --kill-at 12:1 --example-log DIR -- <overrides>

- ``--kill-at <step>:<rank>`` (:class:`KillAt`): that rank SIGKILLs itself right after finishing that
  step, in the first attempt of a torchrun job only (``TORCHELASTIC_RESTART_COUNT`` is 0), so that
  ``torchrun --max-restarts`` restarts the job once and the restart runs to the end.
- ``--signal-at <step>:<rank>`` (:class:`SignalAt`): that rank sends itself SIGTERM during that step,
  in the first attempt only, as a scheduler preempting one node would; the job stops after the step
  on every rank (gem.train.stopping) and torchrun's restart resumes from its checkpoint.
- ``--example-log <folder>`` (:class:`ExampleLog`): every rank appends one JSON line per step to
  ``<folder>/rank<r>.jsonl``: the attempt, the step and a 64-bit hash of each example's dense row,
  so a test can count which examples the surviving training history consumed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by torchrun

from gem.data.pipeline.batch import Batch  # noqa: E402


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def example_ids(dense: torch.Tensor) -> list[str]:
    """A hash of each example's dense row ``[B, num_dense]`` (continuous random features: unique)."""
    rows = dense.detach().cpu().contiguous().numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in rows]


class KillAt:
    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def __call__(self, step: int, rank: int, batch: Batch) -> None:
        if attempt() == 0 and (step, rank) == (self.step, self.rank):
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(KillAt):
    def __call__(self, step: int, rank: int, batch: Batch) -> None:
        if attempt() == 0 and (step, rank) == (self.step, self.rank):
            os.kill(os.getpid(), signal.SIGTERM)


class ExampleLog:
    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def __call__(self, step: int, rank: int, batch: Batch) -> None:
        with (self.folder / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps({"attempt": attempt(), "step": step, "ids": example_ids(batch.dense)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at", help="<step>:<rank>")
    parser.add_argument("--signal-at", help="<step>:<rank>")
    parser.add_argument("--example-log", type=Path)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m gem.train")
    args = parser.parse_args()
    hooks = [ExampleLog(args.example_log)] if args.example_log else []  # logs a step before KillAt ends it
    if args.kill_at:
        hooks.append(KillAt(*map(int, args.kill_at.split(":"))))
    if args.signal_at:
        hooks.append(SignalAt(*map(int, args.signal_at.split(":"))))
    import torch.distributed as dist

    from gem.train.api import compose
    from gem.train.stopping import Preempted
    from gem.train.trainer import train

    try:
        train(compose(args.overrides), hooks=hooks)
    except Preempted as e:  # as python -m gem.train ends a stopped rank
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # as python -m gem.train ends a finished rank
        from gem.train.__main__ import exit_without_finalization

        exit_without_finalization()
