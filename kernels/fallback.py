"""Fast paths that fall back instead of crashing a run: Gluon -> Triton -> the PyTorch reference.

A kernel that fails to build or launch for a reason of the environment (a compiler error, a
Triton or GPU it does not support, too little shared memory: :func:`environment_error`) hands the
call to the next path, once per kernel variant: the failure is recorded (:func:`events`), one
warning names the kernel, the variant, the first line of the error and the setting that turns
the path off, and later calls of that variant take the next path at once. Wrong results are not
a fallback case: nothing here compares numbers, and the tests fail on any recorded fallback.

Two places fall back:

* the Gluon launches (``jagged_attention/launch.py``) run under :func:`guarded`, on the real tensors,
  eagerly or inside the opaque ops that ``torch.compile`` calls as they are;
* the Triton kernels, which ``torch.compile`` compiles itself inside its graph where no ``try``
  can reach, are checked per variant before their first call by :func:`triton_usable`: a tiny
  forward and backward through the op on the device, outside any trace (Dynamo calls the check
  as a constant). A variant that fails runs on the op's reference.

Under ``torch.compile`` the Gluon launches of a variant also run once on tiny inputs while Dynamo
traces (:func:`gluon_checked`), so that a failure falls back before the graph's first run.

Triton's interpreter (``TRITON_INTERPRET=1``) compiles nothing, so no check runs there
(``triton_common.resolve_backend`` asks for none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable

import torch
from triton.errors import TritonError
from triton.runtime.errors import InterpreterError


@dataclasses.dataclass(frozen=True)
class Fallback:
    """One kernel variant that failed here and the path its calls take instead."""

    kernel: str  # e.g. "gluon_fwd", "jagged_attention"
    variant: str  # e.g. "fast_gelu bfloat16 D=128"
    to: str  # the next path: "triton" or "reference"
    error: str  # the first line of the error
    setting: str  # the setting that turns the failed path off

    def message(self) -> str:
        return (
            f"kernel {self.kernel} ({self.variant}) failed here and falls back to {self.to}: "
            f"{self.error} (turn the path off with {self.setting})"
        )


_failed: dict[tuple[str, str], Fallback] = {}
_probed: dict[tuple, bool] = {}  # triton_usable's answers; True while a probe runs (its own calls)
PROBES: dict[str, Callable[..., None]] = {}  # kernel -> probe(*variant): a tiny forward and backward
_checking = 0  # > 0 while a check's probe runs (checking(): its launches are not the caller's)


def device_of(index: int) -> torch.device:
    """A check's device: GPU ``index``, or the CPU (Triton's interpreter) on a machine without one."""
    return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")


def dtype_name(t: torch.Tensor) -> str:
    """``"bfloat16"`` for a bf16 tensor: how a variant names its dtype."""
    return str(t.dtype).removeprefix("torch.")


def environment_error(error: BaseException) -> bool:
    """Whether ``error`` says the kernel cannot build or launch here (Triton's compile, resource
    and PTX errors, a compiler pass failing, a Gluon module missing from this Triton), as opposed
    to bad input, a bug that Triton's interpreter finds, or a device out of memory (torch's, or
    Triton's ``Triton Error [CUDA]: out of memory`` at a launch)."""
    if isinstance(error, (torch.OutOfMemoryError, InterpreterError)) or "out of memory" in str(error):
        return False
    return isinstance(error, (TritonError, RuntimeError, ImportError))


def failed(kernel: str, variant: str) -> bool:
    """Whether ``kernel``'s ``variant`` has fallen back in this process."""
    return (kernel, variant) in _failed


def record(kernel: str, variant: str, to: str, error: BaseException, setting: str) -> Fallback:
    """Records a failed variant and warns once; later calls of it take ``to`` at once."""
    lines = str(error).strip().splitlines()
    first = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    event = Fallback(kernel, variant, to, first[:300], setting)
    if (kernel, variant) not in _failed:
        _failed[(kernel, variant)] = event
        warnings.warn(event.message(), RuntimeWarning, stacklevel=3)
    return _failed[(kernel, variant)]


def events() -> list[Fallback]:
    """Every fallback of this process, in order."""
    return list(_failed.values())


def guarded(kernel: str, variant: str, to: str, setting: str, launch: Callable[[], None]) -> bool:
    """Runs ``launch()``; False (the caller takes ``to``) where it raised an environment error,
    which is then recorded; any other error propagates. Callers skip it for a ``failed`` variant."""
    try:
        launch()
    except Exception as error:
        if not environment_error(error):
            raise
        record(kernel, variant, to, error, setting)
        return False
    return True


@torch.compiler.assume_constant_result
def triton_usable(kernel: str, variant: tuple) -> bool:
    """Whether ``kernel``'s Triton kernels build and run here for ``variant`` (constants: dtype
    and sizes as strings and ints), checked once per variant by ``PROBES[kernel](*variant)``;
    a failure is recorded (next path: the reference) and answers False. Dynamo calls this while
    tracing and takes the answer as a constant."""
    key = (kernel, *variant)
    if key not in _probed:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return True  # no probe inside a CUDA graph's capture: its kernels ran before it
        _probed[key] = True  # the probe's own calls go through
        try:
            with _probe():
                PROBES[kernel](*variant)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # a launch that fails, fails here
        except Exception as error:
            if not environment_error(error):
                raise
            record(kernel, " ".join(map(str, variant)), "reference", error, "kernels.attention_backend=reference")
            _probed[key] = False
    return _probed[key]


@torch.compiler.assume_constant_result
def gluon_checked(kernel: str, variant: tuple) -> bool:
    """Launches the Gluon kernels of ``kernel``'s ``variant`` once, by ``PROBES[kernel](*variant)``
    on tiny inputs, before a ``torch.compile`` graph calls them through its opaque ops: a build
    failure then falls back there (:func:`guarded`, recorded), not inside the graph's first run:
    one there, in a CUDA graph tree's warm-up, failed the tree's memory-pool check (H100, torch
    2.11). True, a constant for Dynamo, which calls this while it traces."""
    key = ("gluon", kernel, *variant)
    if key not in _probed and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        _probed[key] = True
        with _probe():
            PROBES[kernel](*variant)
    return True


def checking() -> bool:
    """Whether a build check's probe is running (test-facing: ``testing.record_paths`` leaves its
    launches out)."""
    return _checking > 0


@contextlib.contextmanager
def _probe():
    """Around a probe: fake tensors off (it launches on real ones, also while Dynamo traces),
    gradients on, :func:`checking` true, and the random number generators as they were: the
    probe's random inputs would otherwise move the CPU's and the current GPU's streams, so a run's
    data order and sampled negatives would depend on whether a check ran earlier in its process."""
    global _checking
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    gpus = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    _checking += 1
    try:
        with unset_fake_temporarily(), torch.enable_grad(), torch.random.fork_rng(devices=gpus):
            yield
    finally:
        _checking -= 1


def clear() -> None:
    """Forgets every fallback and check (test-facing)."""
    _failed.clear()
    _probed.clear()
