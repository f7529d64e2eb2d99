"""The batch contract between the data pipeline and the model (docs/design.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    """One training or evaluation batch of B examples.

    Attributes:
        sparse: pooled id features (user, ad, context ...), one KJT key per feature, multi-hot allowed.
        sequences: per-event ids of every event stream, one key per sequence feature; the keys of
            one sequence group share lengths. Events are oldest first.
        max_seq_len: per sequence group, a host-side upper bound on its lengths in this batch.
        dense: ``[B, num_dense]`` float32.
        labels: ``[B, num_tasks]`` float32 in [0, 1].
        label_mask: ``[B, num_tasks]`` bool, False where a task is unobserved for an example
            (conversion is only observed after a click).
        domain: ``[B]`` int64 surface / domain index.
        weights: optional ``[B]`` float32 example weights.
        request_id: optional ``[B]`` int64 candidate group: rows with one request id are the
            candidates scored for one request (one user); ranking metrics group by it.
        teacher: optional ``[B, num_tasks]`` float32 logits of a teacher model (Parquet columns
            ``teacher_<task>``; NaN for a task without a column), for distillation.
        teacher_repr: optional ``[B, R]`` float32, a teacher's representation of each example
            (Parquet column ``teacher_repr``), a student's input in representation transfer.

    Example, two examples with a history group ``hist`` of two features::

        #                 i = 0        i = 1   <- batch
        # "hist_item"     [7, 3, 9]    []
        # "hist_action"   [0, 1, 0]    []
        # sequences.lengths() = [3, 0, 3, 0]  (key-major: hist_item then hist_action)
    """

    sparse: KeyedJaggedTensor
    sequences: KeyedJaggedTensor
    max_seq_len: dict[str, int]
    dense: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    domain: torch.Tensor
    weights: torch.Tensor | None = None
    request_id: torch.Tensor | None = None
    teacher: torch.Tensor | None = None
    teacher_repr: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as used by ``stream`` (TorchRec's pipelines copy batches on a side stream)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (torch.Tensor, KeyedJaggedTensor)):
                value.record_stream(stream)

    def _map(self, fn) -> Batch:
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = fn(value) if isinstance(value, (torch.Tensor, KeyedJaggedTensor)) else value
        return Batch(**fields)
