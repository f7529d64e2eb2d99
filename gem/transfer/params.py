"""Deprecated: parameter sharing (``checkpoint.init_from`` / ``init_modules`` / ``init_frozen``, the
trainer's keys) lives in :mod:`gem.train.initialize`; this module re-exports it. Import from there."""

import warnings

from gem.train.initialize import *  # noqa: F403
from gem.train.initialize import __all__  # noqa: F401

warnings.warn("gem.transfer.params moved to gem.train.initialize; import from there", DeprecationWarning, stacklevel=2)
