"""The errors gem.data raises for bad input data, so that callers can tell them from bugs.

:class:`DataError` is a ``ValueError`` (a file, row or column the data set should not hold: a schema
mismatch between files, a bad value reported by the checks, an unreadable file);
:class:`MissingDataError` is also a ``FileNotFoundError`` (a missing data set folder, split or
file). The message names the file (and row / column) and the fix; ``python -m gem.train`` prints
it as one line and exits with status 1 (``HYDRA_FULL_ERROR=1`` shows the traceback).
"""


class DataError(ValueError):
    """Bad input data; the message names the file (row, column) and the fix."""


class MissingDataError(DataError, FileNotFoundError):
    """A data set folder, split or file that is missing or empty."""
