"""The on-disk data set: the Parquet layout (layout.py), the checks of files and rows against it
(checks.py), the split folders (dataset.py), the validator CLI (validate.py) and the one reader
(reader.py). Modules import one way: layout <- checks <- dataset, reader, validate; they use the
schema, Batch and balancing of gem/data/pipeline/, whose loader in turn wraps the reader."""
