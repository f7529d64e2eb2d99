"""Test-facing hooks of the jagged attention kernels, for tests and benchmarks only.

The library never calls these; they change the settings in force or watch the kernels' choice
through documented names, so tests and benchmarks need no private ones:

* :func:`override`: the settings in force, changed for a ``with`` block (the environment is not
  applied on top); :func:`preserved`: whatever a block configures is undone after it.
* :func:`record_paths`: the kernels each launch in the block chose, e.g. ``["triton_fwd",
  "triton_dkdv", "dq_from_ds"]`` (names in ``op.py``).
* :func:`forced_config`: launch-config entries that replace the per-head-dim defaults (autotuning
  off), e.g. ``forced_config("fwd", LATE_PV=1)`` for the forward's LATE_PV loop.
* :func:`unverified_gluon`: the Gluon kernels run on a Triton release that ``op.GLUON_VERIFIED``
  does not list, so that their GPU tests can verify a new release.

Launch-level entry points without autograd, for tools that compile or inspect the kernels:
``op.launch_forward`` / ``op.launch_backward`` (``wrap=``, ``config=``, ``arch=``),
``batch_order.batch_order``, ``gluon_fwd.forward``, ``gluon_bwd.dkdv``.
"""

from __future__ import annotations

import contextlib

from kernels.jagged_attention import autotune, op, settings
from kernels.jagged_attention.op import launch_backward, launch_forward, store_ds_row
from kernels.jagged_attention.triton_common import ACTIVATION_CODES, packed_act

__all__ = [
    "ACTIVATION_CODES",
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


@contextlib.contextmanager
def record_paths():
    """Yields a list to which every launch inside the block appends the kernels it chose."""
    saved, op._paths = op._paths, []
    try:
        yield op._paths
    finally:
        op._paths = saved


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
    """Inside the block the Gluon kernels run on any Triton release (``op.GLUON_VERIFIED`` aside)."""
    saved, op._allow_unverified = op._allow_unverified, True
    try:
        yield
    finally:
        op._allow_unverified = saved
