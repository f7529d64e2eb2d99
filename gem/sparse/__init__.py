"""Embedding tables (TorchRec or native): ``SparseArch`` looks up every id feature and sequence
group of a ``FeatureSchema`` (``SparseOutput``: pooled rows and ``JaggedEmbeddings``), built from
``TableSpec``s; ``sparse.ids`` maps raw ids from unbounded spaces to rows (``IdMapper``).
Importing the package checks the versions of torch / FBGEMM / TorchRec / Triton first
(gem/versions.py; GEM_SKIP_VERSION_CHECK=1 skips it); the names are imported on first use."""

from importlib import import_module

from gem.versions import ensure_versions

ensure_versions()

_EXPORTS = {
    "SparseArch": "gem.sparse.arch",
    "SparseOutput": "gem.sparse.arch",
    "JaggedEmbeddings": "gem.sparse.arch",
    "TableSpec": "gem.sparse.tables",
    "build_tables": "gem.sparse.tables",
    "IdMapper": "gem.sparse.ids",
    "IdOutOfRangeError": "gem.sparse.ids",
    "build_id_spaces": "gem.sparse.ids",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gem.sparse' has no attribute {name!r}")
