"""``python -m gem.train [overrides]``: compose configs/train.yaml with Hydra, then ``train(cfg)``.

A mistake the user fixes outside the code prints one line and exits with status 1, as Hydra does
for its own override errors; ``HYDRA_FULL_ERROR=1`` shows the traceback:

- :class:`gem.train.config.ConfigError`: a bad key or value, an impossible layout, a missing
  optional package, a setting this machine cannot run (``kernels=triton`` without a GPU; the line
  names the key);
- :class:`gem.data.DataError`: bad input data (a missing or empty split, files with different
  schemas, an unreadable file, a bad row or column the checks report, an id outside the raw space
  ``sparse.ids`` declares: ``gem.sparse.IdOutOfRangeError``; the line names the file or feature and
  the fix);
- :class:`gem.train.checkpoint.CheckpointError`: a checkpoint that cannot be used;
- :class:`gem.versions.VersionError`: torch, FBGEMM, TorchRec and Triton releases that do not work
  together (the line names them and a combination to install; ``GEM_SKIP_VERSION_CHECK=1`` skips it).

Every other exception keeps its full traceback.
"""

import gc
import logging
import os
import sys

from gem.versions import VersionError, ensure_versions

try:  # before anything imports TorchRec, whose import a mismatched FBGEMM breaks obscurely
    ensure_versions()
except VersionError as e:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise
    print(f"Error in the installed packages: {e}", file=sys.stderr)
    sys.exit(1)

import hydra  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import gem.transfer  # noqa: E402, F401  (the program registers gem.transfer's component with the trainer)
from gem.data.errors import DataError  # noqa: E402
from gem.train.api import config_dir  # noqa: E402
from gem.train.checkpoint import CheckpointError  # noqa: E402
from gem.train.config import ConfigError  # noqa: E402
from gem.train.stopping import Preempted  # noqa: E402
from gem.train.trainer import train  # noqa: E402

CONFIG_DIR = config_dir()  # the checkout's configs/, or gem/configs in an installed wheel
USER_ERRORS = (
    (ConfigError, "Error in the configuration"),
    (DataError, "Error in the data"),
    (CheckpointError, "Error in the checkpoint"),
)


def user_message(e: BaseException) -> str:
    """The message of a user-facing error without the traceback text a DataLoader worker wraps
    it in (``Caught DataError in DataLoader worker process 0. Original Traceback ...``)."""
    text = str(e)
    if text.startswith("Caught ") and "Original Traceback" in text:
        cls = type(e)
        for name in (f"{cls.__module__}.{cls.__qualname__}: ", f"{cls.__qualname__}: "):
            if name in text:
                return text.rsplit(name, 1)[1].strip()
    return text


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except Preempted as e:  # SIGTERM / SIGINT: checkpointed after the step it finished
        rank = f"[rank{os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        print(f"{rank}{e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except tuple(cls for cls, _ in USER_ERRORS) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        what = next(title for cls, title in USER_ERRORS if isinstance(e, cls))
        rank = f"[rank{os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        print(f"{rank}{what}: {user_message(e)}", file=sys.stderr)
        sys.exit(1)  # SystemExit passes through Hydra's handler, which would print a traceback
    finally:  # an orderly teardown, not the collective backend's threads torn down at interpreter exit
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_without_finalization() -> None:
    """Ends a rank of a multi-process run that has finished (files closed, process group destroyed)
    with status 0 and without Python's finalization.

    torch keeps the process groups alive after ``destroy_process_group()`` (a ``DeviceMesh`` kept by
    DTensor's caches holds them in its ``_pg_registry``). A gloo worker thread that frees a finished
    collective's tensors while the interpreter finalizes needs the GIL, and its forced exit aborts
    the process (``terminate called without an active exception``; pytorch/pytorch#179291; rates in
    docs/distributed.md). Leaving here skips only the atexit handlers, once the logs are flushed and
    what is left to collect (a DataLoader iterator shuts its workers down) is collected."""
    gc.collect()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_without_finalization()
