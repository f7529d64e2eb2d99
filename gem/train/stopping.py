"""Preemption-safe stops: SIGTERM (what torchelastic and schedulers send) and SIGINT (Ctrl-C)
finish the current step, write a checkpoint (``checkpoint.enabled``) and end the run with
:class:`Preempted`, which ``python -m gem.train`` turns into one line and the conventional exit
status (128 + the signal: 143, 130). A rerun resumes from that checkpoint: nothing repeated, nothing
lost. A second signal while the step finishes stops at once, as the signal would without gem.

With several ranks each rank's request is combined after every step (a one-int all-reduce on a gloo
group beside the training one), so that every rank stops after the same step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from gem.train.logging import logger

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a signal after ``step``, checkpointed at ``checkpoint`` (None: off)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = (
            f"checkpoint {checkpoint}; rerun the same command to resume"
            if checkpoint
            else ("no checkpoint (checkpoint.enabled=false): a rerun starts over")
        )
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """``with StopSignals(world_size) as stop:`` SIGTERM / SIGINT set ``stop.requested()`` instead of
    ending the process (the main thread only; elsewhere the signals keep their handlers)."""

    def __init__(self, world_size: int = 1) -> None:
        self.signum: int | None = None
        self.world_size = world_size
        self._previous: dict[int, object] = {}
        self._group = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        if self.world_size > 1 and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: as without gem
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.signum = signum
        logger.warning("%s: stopping after this step, with a checkpoint", signal.Signals(signum).name)

    def requested(self) -> int | None:
        """The signal that asks the run to stop (on any rank), or None."""
        if self._group is None:
            return self.signum
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag) or None
