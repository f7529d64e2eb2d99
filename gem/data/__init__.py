"""Data, by concern:

- ``gem.data.format``: the on-disk data set (Parquet layout, checks, validator, the one reader);
- ``gem.data.sources``: where examples come from (synthetic, parquet, seqrec) and
  :func:`build_source`, which turns the ``data`` config into a schema and loaders;
- ``gem.data.pipeline``: the feature schema, the Batch contract, balancing and the loader.

Modules import one way: pipeline.schema / batch / balance <- format.layout <- format.checks <-
format.dataset, format.reader, format.validate <- pipeline.loader <- sources.

Jagged tensor helpers live in kernels/jagged.py. Importing the package loads only its errors and
checks the versions of torch / FBGEMM / TorchRec / Triton (gem/versions.py); the names below are
imported on first use, so ``import gem.data`` stays cheap.
"""

from importlib import import_module

from gem.data.errors import DataError, MissingDataError
from gem.versions import ensure_versions

ensure_versions()

_EXPORTS = {
    "Batch": "gem.data.pipeline.batch",
    "FeatureSchema": "gem.data.pipeline.schema",
    "IdFeature": "gem.data.pipeline.schema",
    "SequenceFeature": "gem.data.pipeline.schema",
    "SequenceGroup": "gem.data.pipeline.schema",
    "BatchLoader": "gem.data.pipeline.loader",
    "build_loader": "gem.data.pipeline.loader",
    "LoaderOptions": "gem.data.format.reader",
    "StreamingParquetReader": "gem.data.format.reader",
    "write_parquet": "gem.data.format.layout",
    "split_files": "gem.data.format.dataset",
    "validate_file": "gem.data.format.validate",
    "DataSource": "gem.data.sources",
    "build_source": "gem.data.sources",
    "SyntheticConfig": "gem.data.sources.synthetic",
}
__all__ = ["DataError", "MissingDataError", *_EXPORTS]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gem.data' has no attribute {name!r}")
