"""GEMModel: ``sparse_arch`` (embeddings, sharded by TorchRec) + ``dense_arch`` (everything else, FSDP2)."""

from __future__ import annotations

import torch
from torch import nn

from gem.data.pipeline.batch import Batch
from gem.sparse.arch import SparseArch


class GEMModel(nn.Module):
    """``forward(batch) -> logits [B, num_tasks]``.

    ``dense_arch`` is any module with ``forward(sparse_output, dense [B, num_dense], domain [B])``
    returning logits, and an ``init_weights()`` method. A dense arch that also reads the ids of
    some sequence features (a generative objective: which item is which) names them in
    ``sequence_ids``; it then gets ``ids={feature: values [T]}`` as well. A dense arch that reads
    a teacher's outputs (knowledge transfer, ``gem.transfer.student``) sets ``teacher_inputs = True``;
    it then gets ``teacher=batch.teacher, teacher_repr=batch.teacher_repr`` as well.
    """

    def __init__(self, sparse_arch: SparseArch | nn.Module, dense_arch: nn.Module) -> None:
        super().__init__()
        self.sparse_arch = sparse_arch
        self.dense_arch = dense_arch

    def forward(self, batch: Batch) -> torch.Tensor:
        embeddings = self.sparse_arch(batch.sparse, batch.sequences, batch.max_seq_len)
        if getattr(self.dense_arch, "teacher_inputs", False):
            return self.dense_arch(
                embeddings, batch.dense, batch.domain, teacher=batch.teacher, teacher_repr=batch.teacher_repr
            )
        names = getattr(self.dense_arch, "sequence_ids", ())
        if names:
            ids = batch.sequences.to_dict()
            return self.dense_arch(embeddings, batch.dense, batch.domain, ids={f: ids[f].values() for f in names})
        return self.dense_arch(embeddings, batch.dense, batch.domain)
