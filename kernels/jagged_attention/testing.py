"""Test-facing hooks of the jagged attention kernels, for tests and benchmarks only.

The library never calls these; they change the settings in force through documented names, so
tests and benchmarks need no private ones (which kernels a call gets is a plain function to call:
``call.choose_forward`` / ``call.choose_backward``):

* :func:`override`: the settings in force, changed for a ``with`` block (the environment is not
  applied on top); :func:`preserved`: whatever a block configures is undone after it.
* :func:`record_paths`: the kernels launched in the block, e.g. ``["triton_fwd", "triton_dkdv",
  "dq_from_ds"]``, seen by wrapping the kernel modules' launchers for the block (the library
  keeps no record of its own).
* :func:`forced_config`: launch-config entries that replace the per-head-dim defaults (autotuning
  off), e.g. ``forced_config("fwd", LATE_PV=1)`` for the forward's LATE_PV loop.
* :func:`unverified_gluon`: the Gluon kernels run on a Triton release that ``call.GLUON_VERIFIED``
  does not list, so that their GPU tests can verify a new release.

Launch-level entry points without autograd, for tools that compile or inspect the kernels:
``launch.forward`` / ``launch.backward`` (an ``AttentionCall``, ``wrap=``, ``arch=``), here as
:func:`launch_forward` / :func:`launch_backward`, ``batch_order.batch_order``,
``gluon_fwd.forward``, ``gluon_bwd.dkdv``.
"""

from __future__ import annotations

import contextlib

from kernels import fallback
from kernels.jagged_attention import autotune, call, settings
from kernels.jagged_attention.call import AttentionCall, store_ds_row
from kernels.jagged_attention.launch import backward as launch_backward
from kernels.jagged_attention.launch import forward as launch_forward
from kernels.jagged_attention.triton_common import ACTIVATION_CODES, packed_act

__all__ = [
    "ACTIVATION_CODES",
    "AttentionCall",
    "forced_config",
    "launch_backward",
    "launch_forward",
    "override",
    "packed_act",
    "preserved",
    "record_paths",
    "store_ds_row",
    "unverified_gluon",
]


@contextlib.contextmanager
def override(**values):
    """The settings in force with ``values`` changed (checked, naming the key) inside the block;
    yields them."""
    saved = settings.current()
    changed = saved.replace(**values)
    settings._set(changed)
    try:
        yield changed
    finally:
        settings._set(saved)


@contextlib.contextmanager
def preserved():
    """The settings in force when the block starts are back in force after it (e.g. around
    ``settings.configure`` calls); yields them."""
    saved = settings.current()
    try:
        yield saved
    finally:
        settings._set(saved)


# (what record_paths calls a launch, module, launcher)
_LAUNCHERS = (
    ("gluon_fwd", "gluon_fwd", "forward"),
    ("triton_fwd", "triton_fwd", "forward"),
    ("gluon_dkdv", "gluon_bwd", "dkdv"),
    ("triton_dkdv", "triton_bwd", "dkdv"),
    ("dq_from_ds", "triton_bwd", "dq_from_ds"),
    ("dq", "triton_bwd", "dq"),
)


@contextlib.contextmanager
def record_paths():
    """Yields a list to which every launch of a jagged attention kernel inside the block appends
    its name (``_LAUNCHERS``) as it starts, one that then fails to build included; a build check's
    launches (``kernels.fallback.checking``) are left out."""
    import importlib

    paths, saved = [], []
    for name, module_name, attr in _LAUNCHERS:
        module = importlib.import_module(f"kernels.jagged_attention.{module_name}")
        launcher = getattr(module, attr)
        saved.append((module, attr, launcher))

        def spy(*args, _launcher=launcher, _name=name, **kwargs):
            if not fallback.checking():
                paths.append(_name)
            return _launcher(*args, **kwargs)

        setattr(module, attr, spy)
    try:
        yield paths
    finally:
        for module, attr, launcher in saved:
            setattr(module, attr, launcher)


@contextlib.contextmanager
def forced_config(kind: str, **entries):
    """Launch configs of kernel ``kind`` (``"fwd"``, ``"dkdv"``, ``"dq"``, ``"dq_ds"``) with
    ``entries`` replacing the defaults' (where autotuning is off) inside the block."""
    saved = dict(autotune._FORCED)
    autotune._FORCED[kind] = autotune._FORCED.get(kind, {}) | entries
    try:
        yield
    finally:
        autotune._FORCED.clear()
        autotune._FORCED.update(saved)


@contextlib.contextmanager
def unverified_gluon():
    """Inside the block the Gluon kernels run on any Triton release (``call.GLUON_VERIFIED`` aside)."""
    saved, call._allow_unverified = call._allow_unverified, True
    try:
        yield
    finally:
        call._allow_unverified = saved
