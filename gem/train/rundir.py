"""A run folder belongs to one run at a time: ``<run_dir>/.gem.lock``.

Rank 0 takes an exclusive ``fcntl`` lock on the file for the whole run and writes its holder into it
(pid, host, start time, command); the operating system drops the lock when the process ends, however
it ends. A second run on the folder stops at start with one line naming the folder, the holder and the
fix, on every rank. A file left by a process that died (its lock gone) is taken over with a warning
naming that holder; a run that ends empties it. ``fcntl`` locks are per host: two hosts sharing a
network file system should not share a run folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from gem.train.config import ConfigError

LOCK = ".gem.lock"


class RunDirInUse(ConfigError):
    """Another run holds ``trainer.run_dir``."""


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["time"]))
        return f"pid {h['pid']} on {h['host']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "an unknown holder"


class RunDirLock:
    """``with RunDirLock(run_dir):`` holds the folder for the block (``run_dir`` is created)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.file = Path(run_dir), None
        self.took_over: str | None = None  # what to warn of: a dead run's lock taken over

    def __enter__(self) -> RunDirLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(self.run_dir / LOCK, "a+")
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(
                f"trainer.run_dir={str(self.run_dir)!r} is a file, or lies under one; give a folder"
            ) from None
        except OSError as e:  # permission denied, a read-only file system, ...
            raise ConfigError(
                f"trainer.run_dir={str(self.run_dir)!r} cannot be written ({e.strerror}); give a writable folder"
            ) from None
        self.file.seek(0)
        previous = self.file.read()
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise RunDirInUse(
                f"trainer.run_dir={str(self.run_dir)!r} is in use by another run ({_holder(previous)}): wait for it "
                "to end, or give this run another trainer.run_dir"
            ) from None
        self.took_over = (
            f"trainer.run_dir={self.run_dir}: took over the lock of a run that ended without releasing it "
            f"({_holder(previous)})"
            if previous.strip()
            else None
        )
        record = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "argv": sys.argv}
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps(record))
        self.file.flush()
        return self

    def __exit__(self, *exc) -> None:
        if self.file is None:
            return
        self.file.seek(0)
        self.file.truncate()  # an empty file: released, nobody to take over from
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        self.file = None


@contextlib.contextmanager
def hold(run_dir: Path, rank: int, world_size: int) -> Iterator[str | None]:
    """``with hold(run_dir, rank, world_size) as took_over:`` the run's hold on its folder: rank 0
    takes the lock; with several ranks every rank learns whether it got it, so that all stop with
    the same line rather than wait for each other. ``took_over``: a warning to log (a dead run's
    lock taken over), or None."""
    lock, error = RunDirLock(run_dir), None
    if rank == 0:
        try:
            lock.__enter__()
        except ConfigError as e:
            error = e
    if world_size > 1 and dist.is_initialized():
        message = [None if error is None else str(error)]
        dist.broadcast_object_list(message, src=0)
        if message[0] is not None and error is None:
            error = RunDirInUse(message[0])
    if error is not None:
        raise error
    try:
        yield lock.took_over
    finally:
        lock.__exit__(None, None, None)
