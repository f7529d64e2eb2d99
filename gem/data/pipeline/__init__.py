"""From files to model inputs: the feature schema (schema.py), the Batch contract (batch.py),
token balancing (balance.py) and the resumable loader (loader.py) over the one reader
(gem/data/format/reader.py)."""
