"""What a data source hands the trainer: the feature schema and a loader per split.

The schema is built one way for every source (:func:`dataset_schema`): ``data.schema`` when the
config gives one, else the ``gem.schema`` metadata that the train split's files carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gem.data.format.dataset import schema_from_files, split_files
from gem.data.pipeline.schema import FeatureSchema

if TYPE_CHECKING:  # the loader imports torch and TorchRec: only when a loader is built
    from gem.data.pipeline.loader import BatchLoader


def dataset_schema(data_cfg: Any, directory: Path | None) -> FeatureSchema:
    """``data.schema`` if given, else the schema in the footers of ``directory``'s train split."""
    if data_cfg.schema:
        return FeatureSchema.from_config(data_cfg.schema)
    if directory is None:
        raise ValueError(
            "data.schema is empty and there is no data set folder to read one from; set data.schema or data.dir"
        )
    return schema_from_files(split_files(directory, "train"))


@dataclass(frozen=True)
class DataSource:
    """A data set ready to read: its ``schema`` and its folder ``dir`` with ``train/``, ``val/`` and
    ``test/`` splits of Parquet files in the gem layout (gem/data/format/)."""

    kind: str
    schema: FeatureSchema
    dir: Path

    @classmethod
    def from_folder(cls, data_cfg: Any, directory: Path) -> DataSource:
        return cls(data_cfg.kind, dataset_schema(data_cfg, directory), Path(directory))

    def files(self, split: str) -> list[Path]:
        """The Parquet files of ``split``; a missing or empty split raises naming the folder."""
        return split_files(self.dir, split)

    def loader(self, split: str, batch_size: int, **kwargs: Any) -> BatchLoader:
        """One rank's loader over ``split`` (keyword arguments as in :func:`gem.data.pipeline.loader.build_loader`)."""
        from gem.data.pipeline.loader import build_loader

        return build_loader(self.files(split), self.schema, batch_size, **kwargs)
