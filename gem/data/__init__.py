"""Data: schema, batches, jagged helpers, readers and checks.

Importing the package loads only its errors, and checks the versions of torch / FBGEMM / TorchRec
/ Triton (gem/versions.py) before a module of it imports TorchRec."""

from gem.data.errors import DataError, MissingDataError
from gem.versions import ensure_versions

ensure_versions()

__all__ = ["DataError", "MissingDataError"]
