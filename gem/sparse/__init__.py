"""Embedding tables (TorchRec or native). Importing the package checks the versions of torch / FBGEMM /
TorchRec / Triton first (gem/versions.py; GEM_SKIP_VERSION_CHECK=1 skips it)."""

from gem.versions import ensure_versions

ensure_versions()
