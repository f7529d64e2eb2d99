"""Data: schema, batches, jagged helpers, readers and checks. Importing the package loads only its errors."""

from gem.data.errors import DataError, MissingDataError

__all__ = ["DataError", "MissingDataError"]
